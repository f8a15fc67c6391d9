"""N-gram speculation on real text: decode tok/s with drafts off and on, the drafts kept, and
whether the greedy answers are the same, on a code-editing set (the prompt holds a file, the
answer rewrites it with a small edit) and on free prose.

    python bench/probes/spec_acceptance.py qwen2.5-coder-0.5b OUT.json [--spec-tokens 4]
        [--repeats 2] [--max-tokens 400] [--temperature T --top-p P]

The engine runs on the CPU (where drafts are checked); off and on alternate per task and repeat,
and a task's decode rate is the median over its repeats, timed from the first token to the last
as the answer streams. With --temperature > 0 the answers are sampled (each repeat its own seed,
the same for off and on): they are then compared by length only, the tokens differ by design.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from sparkinfer_cli.engine.engine import ContinuousBatchEngine, EngineConfig
from sparkinfer_cli.engine.sampling_params import SamplingParams
from sparkinfer_cli.gguf.reader import GGUFFile
from sparkinfer_cli.hub.demo_models import demo_model_path
from sparkinfer_cli.model.loader import load_runtime_model
from sparkinfer_cli.tokenizer.chat_template import ChatTemplate
from sparkinfer_cli.tokenizer.vocab_override import load_tokenizer

FILE = '''import csv
import statistics


def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rows.append(line.split(","))
    return rows


def total(rows, column):
    result = 0
    for row in rows:
        result += float(row[column])
    return result


def average(rows, column):
    if not rows:
        return 0.0
    return total(rows, column) / len(rows)


def median(rows, column):
    values = [float(row[column]) for row in rows]
    return statistics.median(values)


def report(path, column):
    rows = load_rows(path)
    print("rows:", len(rows))
    print("total:", total(rows, column))
    print("average:", average(rows, column))
    print("median:", median(rows, column))
'''
WHOLE_FILE = "Reply with the complete updated file and nothing else."
TASKS = {
    "code-edit: rename": f"```python\n{FILE}```\n\nRename the function `total` to "
                         f"`column_sum` everywhere. {WHOLE_FILE}",
    "code-edit: add a parameter": f"```python\n{FILE}```\n\nGive `load_rows` a parameter "
                                  f"`sep=\",\"` and use it instead of the comma. {WHOLE_FILE}",
    "code-edit: encoding": f"```python\n{FILE}```\n\nOpen the file with "
                           f"`encoding=\"utf-8\"`. {WHOLE_FILE}",
    "prose: story": "Write a short story about a lighthouse keeper who finds a message in a "
                    "bottle.",
    "prose: explain": "Explain how a refrigerator keeps food cold, for a curious ten-year-old.",
}


def answer(engine: ContinuousBatchEngine, prompt_ids: list[int], params: SamplingParams
           ) -> tuple[list[int], float]:
    """The answer's ids and its decode rate (first token to last)."""
    times: list[float] = []
    ids: list[int] = []
    done = threading.Event()

    def on_event(event) -> None:
        times.append(time.perf_counter())
        ids.extend(event.token_ids)
        if event.finish_reason is not None:
            done.set()

    engine.submit(prompt_ids, params, on_event)
    done.wait()
    return ids, (len(ids) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a demo model name")
    parser.add_argument("out", type=Path)
    parser.add_argument("--spec-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()
    gguf = GGUFFile(demo_model_path(args.model))
    model, tokenizer = load_runtime_model(gguf, "cpu"), load_tokenizer(gguf)
    template = ChatTemplate.from_tokenizer(tokenizer)
    engines = {k: ContinuousBatchEngine(model, tokenizer, EngineConfig(
        ctx=4096, spec_tokens=k, prefix_cache=False)) for k in (0, args.spec_tokens)}
    for engine in engines.values():
        engine.start()
    results = []
    try:
        for label, text in TASKS.items():
            ids = tokenizer.encode(template.render([{"role": "user", "content": text}]),
                                   parse_special=True)
            rates: dict[int, list[float]] = {k: [] for k in engines}
            answers: dict[int, list[int]] = {}
            before = engines[args.spec_tokens].stats().speculation
            for repeat in range(args.repeats):
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                        top_p=args.top_p, seed=repeat)
                for k, engine in engines.items():
                    answers[k], rate = answer(engine, ids, params)
                    rates[k].append(rate)
            drafts = engines[args.spec_tokens].stats().speculation.since(before)
            off, on = (statistics.median(rates[k]) for k in engines)
            results.append({
                "task": label, "prompt_tokens": len(ids), "answer_tokens": len(answers[0]),
                "same_answer": answers[0] == answers[args.spec_tokens],
                "decode_tok_s_off": off, "decode_tok_s_on": on, "speedup": on / off,
                "acceptance_rate": drafts.acceptance_rate,
                "mean_accepted_length": drafts.mean_accepted_length,
                "checks": drafts.num_drafts, "answer": tokenizer.decode(answers[0])})
            print(f"{label}: {off:.1f} → {on:.1f} tok/s ({on / off:.2f}×), "
                  f"{100 * drafts.acceptance_rate:.0f} % of drafts kept, "
                  f"{drafts.mean_accepted_length:.2f} tokens a check, same answer: "
                  f"{results[-1]['same_answer']}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    args.out.write_text(json.dumps({"model": args.model, "spec_tokens": args.spec_tokens,
                                    "repeats": args.repeats, "max_tokens": args.max_tokens,
                                    "temperature": args.temperature, "top_p": args.top_p,
                                    "results": results}, indent=2))


if __name__ == "__main__":
    main()
