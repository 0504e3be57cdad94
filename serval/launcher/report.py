"""What the launcher prints once a config is RUNNING: the endpoint with ready-to-paste examples
(``print_usage``) and a self-check (``self_check``: one greedy streamed chat, its answer, time to first
token and per token).
"""

from __future__ import annotations

import json
import time


def self_check(config: dict, timeout_s: float = 120.0) -> str:
    """One streamed greedy chat on the first model of a RUNNING ``config``: its answer, the time to its first
    token and per output token, as a line to print (or why it could not be taken)."""
    import httpx

    model_ids = served_model_ids(config)
    if not model_ids:
        return "Self-check: no model to ask."
    body = {
        "model": model_ids[0],
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    keys = [key for app in config["applications"] for key in (app.get("args") or {}).get("api_keys") or []]
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    start, times, text, tokens = time.monotonic(), [], [], 0
    url = f"{endpoint(config)}/v1/chat/completions"
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                return f"Self-check: the chat request answered HTTP {reply.status_code}."
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                if delta := ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content"):
                    times.append(time.monotonic())
                    text.append(delta)
    except httpx.HTTPError as error:
        return f"Self-check: the chat request failed ({error})."
    if not times:
        return "Self-check: the answer was empty."
    per_token = (times[-1] - times[0]) / max(1, tokens - 1)  # the first chunk holds the first token alone
    return (
        f"Self-check: {''.join(text).strip()!r}: first token {1000 * (times[0] - start):.0f} ms, then "
        f"{1000 * per_token:.0f} ms per token ({tokens} tokens, greedy, one request on its own)."
    )


def endpoint(config: dict) -> str:
    http = config.get("http_options", {})
    return f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}"


def served_model_ids(config: dict) -> list[str]:
    return [
        c["model_loading_config"]["model_id"]
        for app in config["applications"]
        for c in [*(app.get("args") or {}).get("llm_configs", []), (app.get("args") or {}).get("decode_config")]
        if isinstance(c, dict) and "model_loading_config" in c
    ]


def print_usage(config: dict, dashboard: str) -> None:
    """The endpoint of a RUNNING ``config``, with ready-to-paste examples."""
    base, model_ids = endpoint(config), served_model_ids(config)
    model = model_ids[0] if model_ids else "<model id>"
    print(
        f"""
Serval is serving {", ".join(model_ids) or "its models"} at {base}/v1

  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key='none'); \\
r = c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Name three colors.'}}]); \\
print(r.choices[0].message.content)"

Status: serval status   Dashboard: {dashboard}   Stop: Ctrl-C in the foreground, else serval stop
""",
        flush=True,
    )
