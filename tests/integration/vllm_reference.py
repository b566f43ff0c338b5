"""vLLM's own offline greedy output, the reference pdserve's output must equal.

Run as a script (vLLM spawns processes): python vllm_reference.py MODEL_DIR OUT_JSON
Reads {"prompts": [[token ids], ...], "max_tokens": N} from OUT_JSON's sibling input file.
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
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params)
    result = [{"text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
              for o in outputs]
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
