"""Build the toy target/drafter pair from scratch and ship it under assets/toy (what `make toy` runs).

    python toy/build.py                 # reuse finished steps under runs/toy
    python toy/build.py --clean         # everything from scratch (deterministic: fixed seeds)
    python toy/build.py --arch qwen3 --name toy_pure   # the pure-attention pair, in assets/toy_pure

Steps: corpus -> tokenizer -> target pretraining -> `python -m ddtree.train experiment=toy`
(the target answers the train prompts, features, drafter training, evaluation) -> the DFlash2 drafter
(`experiment=toy_dflash2` on the same answers and features) -> the MTP head -> assets/toy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "metrics.json",
                "model-mtp.safetensors", "model.safetensors.index.json")  # the MTP head (qwen3_5_text)


def step(name: str, done: Path, cmd: list[str], timings: dict) -> None:
    if done.exists():
        print(f"== {name}: {done.relative_to(ROOT)} exists, skipped", flush=True)
        return
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    timings[name] = round(time.perf_counter() - t, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clean", action="store_true", help="delete runs/toy first")
    p.add_argument("--arch", default="qwen3_5_text", choices=["qwen3_5_text", "qwen3"])
    p.add_argument("--name", default="toy", help="work in runs/NAME, ship to assets/NAME")
    # one thread: the committed assets are reproduced bit for bit (float reductions depend on the thread
    # count), and a busy 2-core machine oversubscribed by OpenMP slows down many times over
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--no-ship", action="store_true", help="leave assets/toy as it is")
    p.add_argument("--tracking", default="mlflow", choices=["mlflow", "none"])
    args, train_overrides = p.parse_known_args(argv)
    py = sys.executable
    work, assets = ROOT / "runs" / args.name, ROOT / "assets" / args.name
    if args.clean:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    data, tok, target, train = work / "data", work / "tokenizer", work / "target", work / "train"
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    threads = ["--threads", str(args.threads)] if args.threads else []

    step("corpus", data / "eval_prompts.jsonl", [py, "toy/corpus.py", "--out", str(data)], timings)
    step("tokenizer", tok / "tokenizer.json", [py, "toy/tokenizer.py", "--data", str(data), "--out", str(tok)],
         timings)
    step("target", target / "model.safetensors",
         [py, "toy/pretrain.py", "--data", str(data), "--tokenizer", str(tok), "--out", str(target),
          "--arch", args.arch, *threads], timings)
    step("drafter", train / "eval.json",
         [py, "-m", "ddtree.train", "experiment=toy", f"out_dir={train}", f"target.name_or_path={target}",
          f"data.prompts={data / 'train_prompts.jsonl'}", f"eval.prompts={data / 'prompts.jsonl'}",
          f"tracking={args.tracking}", *([f"threads={args.threads}"] if args.threads else []), *train_overrides],
         timings)
    if args.arch == "qwen3_5_text":  # the DFlash2 drafter (docs/dflash2.md), on the DFlash drafter's answers and features
        train2 = work / "train2"
        for part in ("data", "features"):  # the same target, prompts and layers: the same files
            if (train / part).exists() and not (train2 / part).exists():
                shutil.copytree(train / part, train2 / part)
        step("drafter2", train2 / "eval.json",
             [py, "-m", "ddtree.train", "experiment=toy_dflash2", f"out_dir={train2}", f"target.name_or_path={target}",
              f"data.prompts={data / 'train_prompts.jsonl'}", f"eval.prompts={data / 'prompts.jsonl'}",
              f"tracking={args.tracking}", *([f"threads={args.threads}"] if args.threads else [])], timings)
    if args.arch == "qwen3_5_text":  # the family's own MTP head, beside the target's weights (docs/mtp.md)
        step("mtp", target / "model-mtp.safetensors",
             [py, "-m", "ddtree.train.mtp", "--target", str(target), "--drafter", str(train / "drafter"),
              "--prompts", str(data / "train_prompts.jsonl"), "--eval-prompts", str(data / "prompts.jsonl"),
              "--work", str(work / "mtp"), "--max-samples", "1200", "--epochs", "10", "--lr", "3e-3", "--install",
              *threads], timings)
    timings["total"] = round(time.perf_counter() - t0, 1)

    if not args.no_ship:
        shutil.rmtree(assets, ignore_errors=True)
        (assets / "target").mkdir(parents=True)
        for name in TARGET_FILES:
            if (target / name).exists():
                shutil.copy2(target / name, assets / "target" / name)
        shutil.copytree(train / "drafter", assets / "drafter")
        if (work / "train2" / "drafter").exists():
            shutil.copytree(work / "train2" / "drafter", assets / "drafter2")
            shutil.copy2(work / "train2" / "eval.json", assets / "eval2.json")
        for name in ("prompts.jsonl", "train_prompts.jsonl", "eval_prompts.jsonl"):
            shutil.copy2(data / name, assets / name)
        shutil.copy2(train / "eval.json", assets / "eval.json")
        (assets / "build.json").write_text(json.dumps({"arch": args.arch, "seconds": timings}, indent=1) + "\n")
        size = sum(f.stat().st_size for f in assets.rglob("*") if f.is_file())
        print(f"== shipped {assets.relative_to(ROOT)} ({size / 2**20:.1f} MiB)")
    print(f"== timings (s): {timings}")


if __name__ == "__main__":
    main()
