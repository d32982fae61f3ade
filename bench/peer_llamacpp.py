"""llama.cpp's runner for the GGUF baseline (``kiln_bench.llamacpp``): run in llama.cpp's own environment
(llama-cpp-python), importing nothing of kiln. JSON in argv[1], JSON out on stdout.

``{"mode": "decode", "model": file, "threads": 1, "prompt": str, "tokens": N, "repeats": R}``: one request's
decode tokens per second: (the time of N + 1 generated tokens - the time of 1) / N, greedy, EOS ignored,
the median over R repeats.
"""

from __future__ import annotations

import json
import sys
import time


def decode(cfg: dict) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=cfg["model"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"], n_ctx=1024,
                n_batch=512, verbose=False)
    eos = llm.token_eos()
    toks = llm.tokenize(cfg["prompt"].encode())

    def run(n: int) -> float:
        llm.reset()
        t0 = time.perf_counter()
        got = 0
        for _ in llm.generate(toks, temp=0.0, top_k=1, logits_processor=[_no_eos(eos)], reset=True):
            got += 1
            if got >= n:
                break
        return time.perf_counter() - t0

    run(4)  # warm-up
    rates = []
    for _ in range(cfg["repeats"]):
        one, many = run(1), run(cfg["tokens"] + 1)
        rates.append(cfg["tokens"] / (many - one))
    rates.sort()
    return {"decode_tok_s": rates[len(rates) // 2], "all": rates}


def _no_eos(eos: int):
    import numpy as np

    def proc(input_ids, scores):
        scores = np.array(scores, copy=True)
        scores[eos] = -np.inf
        return scores
    return proc


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    print(json.dumps(decode(cfg)))
