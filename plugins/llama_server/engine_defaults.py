"""llama-server's defaults when a user types ``llama-server -m MODEL``: what a study's
baseline measures (the ``llama-server`` backend) and predicts (the twin of it).

From llama.cpp 0.3.36's sources, vendored in the engine build's src/: -c 0, the model's trained
context (common/common.h: n_ctx = 0); -np -1, "auto" (common/arg.cpp sets it for
LLAMA_EXAMPLE_SERVER), which tools/server/server.cpp turns into 4 slots sharing one unified KV
pool (kv_unified = true); -fa auto, -ctk/-ctv f16, -b 2048, -ub 512, --fit on (shrinks an unset
context to fit the card, not below 4096; common/common.h), -ngl -1 "auto" (the fitting chooses
the offload), -t the machine's math cores.
"""

DEFAULT_SLOTS = 4
ENGINE_DEFAULTS = "engine_defaults"  # the baseline's marker option: leave every flag but -m out
# Its value for the second baseline, llama.cpp's own choice: -c and -np from the user (ctx x
# slots, as a trial's), --fit on, every other flag (-ngl included) at the default, so the fitting
# decides the offload (common/common.h: n_gpu_layers = -1, "auto"; fit_params adjusts what is unset).
FIT = "fit"
