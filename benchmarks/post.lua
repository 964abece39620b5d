-- wrk script: POST one OpenAI chat completion per request.
-- BODY and the path come from the environment so one script serves every run.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("WRK_BODY") or '{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":16}'
wrk.path = os.getenv("WRK_PATH") or "/v1/chat/completions"

local errors = 0
function response(status, headers, body)
  if status ~= 200 then
    errors = errors + 1
  end
end

function done(summary, latency, requests)
  io.write(string.format("NON2XX %d\n", summary.errors.status))
end
