"""vLLM's own offline output, the reference pdserve's output must equal.

Run as a script (vLLM spawns processes): python vllm_reference.py MODEL_DIR IN_JSON OUT_JSON
IN_JSON is {"prompts": [[token ids], ...], "max_tokens": N} (greedy), or {"requests": [{"prompt":
[token ids], "max_tokens": N, and any of temperature, seed, stop, presence_penalty,
frequency_penalty}, ...]}; "enable_prefix_caching": false turns vLLM's prefix cache off (the
service under test runs without it too, so no prompt is computed in other chunks than here).
"""

import json
import os
import sys


def main() -> None:
    model, request_path, out_path = sys.argv[1:4]
    request = json.loads(open(request_path).read())
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The same engine settings pdserve derives for the CPU (pdserve/engine/vllm_engine.py).
    llm = LLM(model=model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1024**3,
              seed=0, enable_prefix_caching=request.get("enable_prefix_caching", True))
    if "requests" in request:
        prompts = [r["prompt"] for r in request["requests"]]
        params = [SamplingParams(**{"temperature": 0.0, **{k: v for k, v in r.items()
                                                            if k != "prompt"}})
                  for r in request["requests"]]
    else:
        prompts = request["prompts"]
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids),
               "finish_reason": o.outputs[0].finish_reason} for o in outputs]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
