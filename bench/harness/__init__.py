"""Shared machinery of the depth sweeps: providers, measurement, max-depth search
and output (table, CSV, PNG).

A sweep script describes its workload (:class:`Workload`) and its defaults per
device (:func:`parse_arguments`); :func:`run_benchmark` does the rest:

1. For each depth, one seeded model and one batch. Every provider trains a deep copy
   of the same model on the same batch, so gradients compare exactly.
2. Per provider: one warm-up step (it allocates the gradients, so they are resident
   like in training, and lets segments="balanced" plan). Then ``repeats`` rounds in
   which every provider times one step in turn (ABAB...: a slow phase of a shared
   machine falls on all of them alike), then per provider one step under the
   memory tracker, and the same step predicted on meta tensors
   (:func:`actsave.estimate`), to validate the meta estimates at real scale. A step
   is forward, cross-entropy loss and backward. The optimizer step is left out: it
   touches no activation and costs every provider the same.
3. ``max_depth`` per provider: the deepest model whose step peaks within
   ``--budget``, found by real measurements (a search over blocks that starts from
   the swept depths, see :func:`deepest_fitting`), within ``--search-seconds``;
   past that the result is labelled a lower bound. A workload with a real-scale
   stage (bench/real_scale.py) searches on meta tensors at real scale instead.
4. A table on stdout, long-format rows in a CSV, a PNG next to it: the max depths as
   bars (how much deeper each provider trains in the same memory), and against depth
   the step peak (with the budget ``segments="auto"`` plans for), the time ratio and
   the real-scale device peak. Pictures name providers as the API does
   (``DISPLAY_NAMES``).

Where results go: ``bench/results/local/`` (git-ignored), unless ``--record`` says to
update the committed ``bench/results/`` (``--out`` names a path instead); every bench
script takes its paths from :func:`output_path`. ``--replot`` measures nothing: it draws
a sweep's PNG again from its rows in the CSV.

Metrics (see ``METRICS``): ``peak_mem`` is the peak of everything live during the
step. ``peak_act_mem`` subtracts what was resident when the step began: parameters,
buffers, gradients and the batch (there is no optimizer state). ``est_act_mem`` is
the same quantity predicted on meta tensors. ``kept_bytes`` is what actsave holds
for backward at the end of forward (actsave providers only:
:func:`actsave.kept_bytes`, device and host). ``time`` is timed without the memory
tracker; ``time_ratio`` and ``grad_sqnr`` are against the ``torch`` provider of the
same run, which is therefore always measured.

Memory on CUDA is ``max_memory_allocated``; on CPU it is PyTorch's ``MemTracker``
(docs/architecture.md), which counts live tensor storages exactly. CPU times are
indicative only.
"""

# The names the bench scripts and tests/bench use, as ``harness.X``.
from .cli import SIZED_OPTIONS, parse_arguments, parse_budget, parse_depths, parse_device, run_benchmark
from .measure import (MemTracker, _GlobalPeakMemTracker, activation_peak, allocator_peak, allocator_rise,
                      count_frees_on_every_thread, estimated_act_peak, imports_frozen, interleaved_times,
                      measure_step_memory, process_allocator_peak, sqnr_db, training_step)
from .progress import Progress
from .providers import (BLOCK_PROVIDERS, DISPLAY_NAMES, PROVIDERS, REFERENCE, BlockProvider, Provider, ProviderError,
                        available_providers, display_name)
from .report import (MATPLOTLIB_MISSING, STYLES, _fixed_width, _medians, max_depth_table, plot, pyplot, save_figure,
                     style)
from .results import (LOCAL_RESULTS_DIR, RESULTS_DIR, add_output_arguments, csv_row, device_name, device_slug,
                      output_path, results_dir, run_metadata, write_csv, wrote)
from .search import MaxDepthSearch, deepest_fitting, search_max_depths
from .workload import SEED, Measurement, MiB, Workload

__all__ = [
    "BLOCK_PROVIDERS", "BlockProvider", "DISPLAY_NAMES", "LOCAL_RESULTS_DIR", "STYLES", "add_output_arguments",
    "display_name", "output_path", "plot", "results_dir", "style", "wrote",
    "MATPLOTLIB_MISSING", "PROVIDERS", "REFERENCE", "RESULTS_DIR", "SEED", "SIZED_OPTIONS", "MaxDepthSearch",
    "Measurement", "MemTracker", "MiB", "Progress", "Provider", "ProviderError", "Workload",
    "_GlobalPeakMemTracker", "_fixed_width", "_medians", "activation_peak", "allocator_peak", "allocator_rise",
    "count_frees_on_every_thread", "process_allocator_peak", "available_providers", "deepest_fitting", "device_name",
    "estimated_act_peak", "imports_frozen",
    "device_slug", "interleaved_times", "max_depth_table", "measure_step_memory", "parse_arguments", "parse_budget",
    "parse_depths", "pyplot", "run_benchmark", "run_metadata", "save_figure", "search_max_depths", "training_step",
    "write_csv", "csv_row", "parse_device", "sqnr_db",
]
