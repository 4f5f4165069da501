"""Where a training step's time goes on a GPU, without hpo's loop: BERT-base (built from
bench/configs/bert-base-nli.yaml's model config) at one length and batch, the bare step
(forward, loss, backward, clip, fused AdamW), one variant at a time, each timed with the device
synchronised, as ms per step and model FLOPs utilisation counting every token (all are real).

    python3 bench/step_anatomy.py --length 512 --batch 16 --profile   # on a GPU (issue 30)

Variants: eager or compiled (static shapes, the batch dimension dynamic, or by blocks as hpo
compiles); CUDA graphs (torch.compile's reduce-overhead, or the whole step captured as one graph);
the attention mask given (all ones, as a padded batch gives it) or left out (SDPA may then use
its flash kernel); fp32 weights under bf16 autocast (hpo's precision) or bf16 weights; the
gradient clip on or off. The gap between the best variant and hpo's own loop
(trainer_throughput.py --engines ours) is the loop's cost; the gap between the best variant and
the device's peak is the kernels'.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from trainer_throughput import PEAK_TFLOPS, flops_per_token  # noqa: E402


def model_config(path: Path) -> transformers.PretrainedConfig:
    settings = dict(yaml.safe_load(path.read_text())["model"]["config"])
    kind = settings.pop("model_type")
    return transformers.AutoConfig.for_model(kind, num_labels=3, **settings)


class Variant:
    def __init__(
        self,
        name: str,
        *,
        compiled: str = "",
        mask: bool = True,
        bf16: bool = False,
        clip: bool = True,
        batch: int | None = None,
        graph: str = "",
    ) -> None:
        self.name, self.compiled, self.mask, self.bf16, self.clip = name, compiled, mask, bf16, clip
        self.batch = batch
        # "": none; "reduce-overhead": torch.compile's CUDA graphs (forward and backward);
        # "step": the whole step (forward, backward, clip, AdamW) captured as one CUDA graph
        self.graph = graph


VARIANTS = [
    Variant("eager, mask, fp32 weights + autocast (hpo eager)"),
    Variant("eager, no mask", mask=False),
    Variant("eager, no clip", clip=False),
    Variant("eager, bf16 weights", bf16=True),
    Variant("compiled dynamic batch, mask (hpo compiled)", compiled="dynamic"),
    Variant("compiled static, mask", compiled="static"),
    Variant("compiled static, no mask", compiled="static", mask=False),
    Variant("compiled static, mask, batch x4", compiled="static", batch=4),
    # Issue 48: short sequences, where launching kernels, not computing them, sets the pace
    Variant(
        "compiled static, CUDA graphs (reduce-overhead)", compiled="static", graph="reduce-overhead"
    ),
    Variant("eager, whole step one CUDA graph", graph="step"),
    Variant("compiled static, whole step one CUDA graph", compiled="static", graph="step"),
    Variant("compiled by blocks (hpo's auto above 12), dynamic", compiled="blocks"),
]


def make_step(
    variant: Variant,
    cfg: transformers.PretrainedConfig,
    batch: int,
    length: int,
    device: torch.device,
) -> tuple[Callable[[], torch.Tensor], torch.nn.Module]:
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(
        cfg, attn_implementation="sdpa"
    ).to(device)
    if variant.bf16:
        model = model.to(torch.bfloat16)
    model.train()
    # A captured step keeps its learning rate and step count on the device (capturable)
    capturable = variant.graph == "step"
    lr = torch.tensor(1e-5, device=device) if capturable else 1e-5
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=capturable)
    forward: torch.nn.Module = model
    if variant.compiled == "blocks":
        from hpo.trainer.compiled import repeated_blocks

        for block in repeated_blocks(model):
            block.compile(dynamic=True)
    elif variant.compiled:
        # hpo compiles with dynamic=None and marks the batch dimension (trainer.compiled)
        dynamic = None if variant.compiled == "dynamic" else False
        mode = "reduce-overhead" if variant.graph == "reduce-overhead" else None
        forward = torch.compile(model, dynamic=dynamic, mode=mode)  # type: ignore[assignment]
    ids = torch.randint(1000, int(cfg.vocab_size or 30522), (batch, length), device=device)
    mask = torch.ones_like(ids) if variant.mask else None
    labels = torch.randint(0, cfg.num_labels or 3, (batch,), device=device)
    if variant.compiled == "dynamic":
        torch._dynamo.maybe_mark_dynamic(ids, 0)  # as trainer.compiled does
        if mask is not None:
            torch._dynamo.maybe_mark_dynamic(mask, 0)

    def step() -> torch.Tensor:
        if variant.graph == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        # a captured step must not reuse autocast's casts cached outside the capture
        with torch.autocast(
            device.type,
            dtype=torch.bfloat16,
            enabled=not variant.bf16,
            cache_enabled=not capturable,
        ):
            logits = forward(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        if variant.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        if variant.graph != "step":  # a captured step keeps its gradients' memory
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if variant.graph == "step":
        return captured(step), model
    return step, model


def captured(step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`step` recorded once as a CUDA graph (after warm-up steps on a side stream, as torch's
    whole-network capture does), each call one replay: no kernel launched from Python."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return loss

    return replay


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step: Callable[[], torch.Tensor], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - started) / steps


def profile(step: Callable[[], torch.Tensor], steps: int, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync()
    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    wall = time.perf_counter() - started
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    print(f"device busy {busy:.3f} s of {wall:.3f} s ({100 * busy / wall:.0f}%)", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "bench/configs/bert-base-nli.yaml"))
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", default="", help="variant numbers (from 1), run in this order")
    parser.add_argument("--profile", default="", help="variant numbers to profile, e.g. 1,6")
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--device", default="cuda", help="cpu only to try the script itself")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: step_anatomy.py measures a GPU; none is visible", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), 989.0)
    cfg = model_config(Path(args.config))
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.length)
    chosen = [int(n) for n in args.only.split(",") if n] or list(range(1, len(VARIANTS) + 1))
    profiled = {int(n) for n in args.profile.split(",") if n}
    print(
        f"{name}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"length {args.length}, batch {args.batch}, peak {peak:g} TFLOPS"
    )
    print("| # | variant | batch | ms/step | TFLOPS | MFU |\n|---:|---|---:|---:|---:|---:|")
    for number in chosen:  # in the order given: the most telling first, when time is short
        variant = VARIANTS[number - 1]
        batch = args.batch * (variant.batch or 1)
        started = time.perf_counter()
        try:
            step, model = make_step(variant, cfg, batch, args.length, device)
            seconds = time_steps(step, args.steps, args.warmup)
        except Exception as e:  # one variant failing (a capture refused) leaves the others
            print(
                f"| {number} | {variant.name} | {batch} | failed: {type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]} |",
                flush=True,
            )
            torch.compiler.reset()
            continue
        flops = flops_per_token(model, args.length) * batch * args.length  # the MFU of bench/README
        tflops = flops / seconds / 1e12
        print(
            f"| {number} | {variant.name} | {batch} | {1000 * seconds:.1f} | {tflops:.0f} "
            f"| {100 * tflops / peak:.1f}% |  (wall {time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        if number in profiled:
            profile(step, 5, args.rows)
        del step, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
