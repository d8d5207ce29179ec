"""`sluice up --engine cuda` end to end through the `openai` client (the
device run's step; the client travels as wheels): chat, the same chat
streamed, and a completion, greedy. Writes what it saw to OUT.json and exits
non-zero if any check fails.

    python3 e2e.py BASE_URL OUT.json
"""

import json
import sys

from openai import OpenAI


def main(base, path):
    client = OpenAI(base_url=base + "/v1", api_key="sluice", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name three rivers."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    text = chat.choices[0].message.content or ""
    streamed = ""
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
    completion = client.completions.create(model=model, prompt="The river", max_tokens=16, temperature=0)
    checks = {
        "chat has text": bool(text),
        "chat counts its tokens": (chat.usage.completion_tokens or 0) > 0,
        "streamed chat equals the chat (greedy)": streamed == text,
        "completion has text": bool(completion.choices[0].text),
    }
    out = {"model": model, "chat": text, "streamed": streamed,
           "completion": completion.choices[0].text,
           "usage": chat.usage.model_dump(), "checks": checks, "ok": all(checks.values())}
    print(json.dumps(out, indent=1))
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
