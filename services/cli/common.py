"""Option groups several subcommands share (target, engine, sampling)."""

from __future__ import annotations

import argparse

from services.cli.types import positive_int, torch_device


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=None,
        help="local Hugging Face model folder (default: SmolLM2-135M-Instruct, fetched once)",
    )
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (Ray actors)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="activations, KV cache and dense weights: auto (timed at start), float32, bfloat16",
    )
    p.add_argument(
        "--quant",
        default="auto",
        help="GEMM weights: auto (timed at start), none, int8, int4 (GGUF Q4_1's grid); "
        "int8-q8 / int4-q8: the same weights with llama.cpp's int8 activations (faster, "
        "rounded as llama.cpp rounds)",
    )
    p.add_argument(
        "--kv-dtype",
        default="auto",
        help="KV cache: auto (as --dtype), float32, bfloat16 (half the bytes attention reads)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=["spec", "ar"],
        default="spec",
        help="spec = speculative decoding (default), ar = plain decoding",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="drafter folder (default: the shipped drafter; 'random' = untrained)",
    )
    p.add_argument("--k", type=positive_int, default=None, help="draft tokens per round")
    p.add_argument("--no-carry", action="store_true", help="turn Carryover off (ablation)")
    p.add_argument(
        "--fixed-k",
        action="store_true",
        help="draft k tokens every round (default: adapt k per round, 0 when drafting cannot pay)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="the target (each TP rank on a GPU of its own) and the drafter: cpu or cuda",
    )
    p.add_argument(
        "--drafter-device",
        type=torch_device,
        default=None,
        help="local backend: the drafter on another device than the target, e.g. cuda:1",
    )
    p.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="local = one process; ray = target TP ranks and drafter as Ray actors",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_options(args: argparse.Namespace):
    from services.engine.backends import EngineOptions

    return EngineOptions(
        target=args.target,
        tp=args.tp,
        dtype=args.dtype,
        quant=args.quant,
        kv_dtype=args.kv_dtype,
        mode=getattr(args, "mode", "ar"),
        drafter=getattr(args, "drafter", None),
        k=getattr(args, "k", None),
        adaptive=not getattr(args, "fixed_k", False),
        carry=not getattr(args, "no_carry", False),
        device=getattr(args, "device", "cpu"),
        drafter_device=getattr(args, "drafter_device", None),
    )
