-- wrk script for tests/bench/frontend/run.sh: a small streaming chat
-- request (about 17 prompt tokens, ignore_eos) and one JSON summary line.
-- Environment: WRK_MODEL [sluice-tiny], WRK_MAX_TOKENS [8], WRK_STREAM [true].
local model = os.getenv("WRK_MODEL") or "sluice-tiny"
local max_tokens = os.getenv("WRK_MAX_TOKENS") or "8"
local stream = os.getenv("WRK_STREAM") or "true"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"' .. model .. '","messages":[{"role":"user","content":"The quick brown fox jumps over the lazy dog again and again"}],"max_tokens":'
  .. max_tokens .. ',"ignore_eos":true,"stream":' .. stream .. '}'

done = function(summary, latency, requests)
  local s = summary.duration / 1e6
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_s":%.3f,"rps":%.1f,"errors":%d,"lat_p50_ms":%.3f,"lat_p90_ms":%.3f,"lat_p99_ms":%.3f}\n',
    summary.requests, s, summary.requests / s, e.status + e.connect + e.read + e.write + e.timeout,
    latency:percentile(50) / 1e3, latency:percentile(90) / 1e3, latency:percentile(99) / 1e3))
end
