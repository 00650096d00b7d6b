"""llama.cpp's OpenAI server as a peer: run by ``.venv-llama/bin/python`` (not the project's venv).

``bench peers --served`` starts this file rather than ``python -m llama_cpp.server`` so as
to pass what that server's flags cannot: ``--no-extra-bufts`` loads the weights without
llama.cpp's extra CPU buffer types (its AMX tiles, repacked layouts). On a CPU with AMX the
AMX matmul of llama-cpp-python 0.3.36 crashes on the default Q4_1 file at the first request
(a segfault in ``ggml_backend_amx_mul_mat``); without it llama.cpp runs its AVX-512 kernels.
Every other argument goes to the server as it is. Standard library and llama_cpp only.
"""

import runpy
import sys


def main() -> None:
    args = sys.argv[1:]
    if "--no-extra-bufts" in args:
        args.remove("--no-extra-bufts")
        import llama_cpp.llama_cpp as lib  # what llama_cpp.Llama reads its defaults from

        defaults = lib.llama_model_default_params

        def params():
            p = defaults()
            p.use_extra_bufts = False
            return p

        lib.llama_model_default_params = params
    sys.argv = ["llama_cpp.server", *args]
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
