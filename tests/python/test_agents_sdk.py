"""The OpenAI Agents SDK (its default model class speaks the Responses API)
against `sluice up`: an agent with a function tool runs to a final answer."""

import asyncio
from typing import Annotated

import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
from pydantic import Field


@pytest.fixture
def model(sluice):
    # One client per test: each test runs its own event loop.
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"http://{sluice}/v1", api_key="unused", max_retries=0)
    return OpenAIResponsesModel(model="sluice-tiny", openai_client=client)


def test_an_agent_calls_its_tool_and_answers(model):
    called = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        called.append(city)
        return f"sunny in {city}"

    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,
        tools=[get_weather],
        # The model must call the tool (random weights would rarely choose
        # to), and the tool's answer is the agent's.
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, extra_body={"seed": 3}
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=4, run_config=RunConfig(tracing_disabled=True)))
    assert called, "the tool ran"
    assert result.final_output == f"sunny in {called[0]}"

