"""bench/launch_overhead.py at smoke scale on CPU: every launcher and reference runs,
through Triton's interpreter (the times mean nothing there; the GPU stage reads them)."""
from support import run_script


def test_launch_overhead_times_every_launcher_and_its_references():
    stdout = run_script("launch_overhead.py")
    assert "Triton's interpreter: the times mean nothing" in stdout
    rows = {line.split("  ")[0] for line in stdout.splitlines()[2:] if line.strip()}
    references = {"torch operator (x.add_(1))", "Triton kernel[grid](...), one program",
                  "the same through _launch.launch"}
    launchers = {f"{codec} {direction}, {layout}" for codec in ("int8", "fp8_e4m3") for direction in ("encode", "decode")
                 for layout in ("centered", "unsigned", "flat")} | {"ReLU signs packed", "ReLU signs restored"}
    assert references | launchers <= rows
