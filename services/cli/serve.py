"""``longspark serve``: the OpenAI API on Ray Serve (``services.serving.launch``)."""

from __future__ import annotations

import argparse

from services.cli.types import gpu_share
from services.cli.types import positive_int as _positive_int
from services.serving.launch import DEFAULT_CONFIG


def add_parser(sub) -> None:
    serve = sub.add_parser(
        "serve", help="serve an OpenAI-compatible API (Ray Serve) on 127.0.0.1:8000"
    )
    add_serve_args(serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options (unset ones come from the config file)."""
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default=None, help="bind address (default: 127.0.0.1)")
    http.add_argument("--port", type=_positive_int, default=None, help="port (default: 8000)")
    http.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY'; several comma-separated "
        "(default: $LONGSPARK_API_KEY; unset = open)",
    )
    http.add_argument(
        "--api-key-file",
        default=None,
        help="file of accepted keys, one per line (default: $LONGSPARK_API_KEY_FILE)",
    )
    http.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        help="allow this browser origin (repeatable; default: CORS off)",
    )
    http.add_argument(
        "--grace-period",
        type=float,
        default=None,
        help="on SIGTERM, seconds in-flight requests may take to finish (default: 30)",
    )
    http.add_argument(
        "--max-tokens-limit",
        type=_positive_int,
        default=None,
        help="largest max_tokens a request may ask for (default: 4096)",
    )
    http.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=None,
        help="stream every N tokens; the first goes at once (default: 1, every token)",
    )
    http.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    http.add_argument(
        "--no-direct-ingress",
        action="store_true",
        help="route HTTP through Serve's proxy even with one replica (by default one replica"
        " with the API inside it serves the port itself: no proxy hop per streamed chunk)",
    )
    model = p.add_argument_group("model and engine")
    model.add_argument("--target", default=None, help="local HF folder (default: SmolLM2-135M)")
    model.add_argument("--tp", type=_positive_int, default=None, help="target TP degree")
    model.add_argument("--mode", choices=["spec", "ar"], default=None, help="spec or plain (ar)")
    model.add_argument(
        "--drafter", default=None, help="drafter folder or 'random' (default: the shipped one)"
    )
    model.add_argument("--k", type=_positive_int, default=None, help="draft tokens per round")
    model.add_argument(
        "--fixed-k",
        dest="adaptive",
        action="store_const",
        const=False,
        default=None,
        help="draft k every round (default: adapt k per round, plain when drafting cannot pay)",
    )
    model.add_argument(
        "--max-num-seqs", type=_positive_int, default=None, help="running sequences per replica"
    )
    model.add_argument(
        "--dtype", default=None, help="activations / KV / dense weights: auto, float32, bfloat16"
    )
    model.add_argument(
        "--quant", default=None, help="GEMM weights: auto, none, int8, int4, int8-q8, int4-q8"
    )
    model.add_argument(
        "--kv-dtype", default=None, help="KV cache: auto (as --dtype), float32, bfloat16"
    )
    model.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="cuda: every target rank on a GPU of its own (NCCL), the drafter on one too"
        " (default: cpu)",
    )
    model.add_argument(
        "--gpus-per-rank",
        type=gpu_share,
        default=None,
        help="share of a GPU each target rank reserves (default: 1)",
    )
    model.add_argument(
        "--drafter-gpus",
        type=gpu_share,
        default=None,
        help="share of a GPU the drafter reserves (default: 1; 0.5 with --gpus-per-rank 0.5"
        " puts a TP=1 target and the drafter on one GPU)",
    )
    model.add_argument(
        "--target-process",
        choices=["auto", "replica", "actors"],
        default=None,
        help="where the target computes: the engine replica's own process (one rank, no hop"
        " a round), Ray actors (one per rank), or auto (replica at tp 1; default)",
    )
    model.add_argument(
        "--generation-config",
        default=None,
        help="sampling defaults: auto (the model's generation_config.json), vllm (none)"
        " or a folder",
    )
    scale = p.add_argument_group("replicas")
    scale.add_argument("--min-replicas", type=_positive_int, default=None)
    scale.add_argument("--max-replicas", type=_positive_int, default=None)
    scale.add_argument(
        "--ingress",
        choices=["replica", "separate"],
        default=None,
        help="the API inside each engine replica (default) or in its own deployment",
    )
    p.add_argument(
        "--config",
        default=None,
        help=f"Serve config whose app args are the defaults (default: {DEFAULT_CONFIG.name})",
    )


def run(args: argparse.Namespace) -> None:
    from services.serving.launch import run_server

    run_server(args)
