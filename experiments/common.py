"""What every experiment shares: the machine's name, the report file, plots. No experiment logic here."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"


def machine_name() -> str:
    """``"<cpu or GPU name>, <n> cores, torch <version>"``: the line every report names its machine with."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine()
        try:
            model = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
            device = model[0].split(":", 1)[1].strip() if model else device
        except OSError:
            pass
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def command_line() -> str:
    return "python " + " ".join(
        [
            Path(sys.argv[0]).relative_to(Path.cwd()).as_posix()
            if Path(sys.argv[0]).is_absolute() and Path(sys.argv[0]).is_relative_to(Path.cwd())
            else sys.argv[0],
            *sys.argv[1:],
        ]
    )


def write_report(name: str, title: str, sections: list[str], seconds: float, out_dir: Path = RESULTS) -> Path:
    """``<out_dir>/<name>.md``: the title, the command, the machine and wall time, then the sections."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = [
        f"# {title}",
        "",
        f"Command: `{command_line()}`  ",
        f"Machine: {machine_name()}  ",
        f"Wall time: {seconds:.0f} s",
        "",
    ]
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(header + sections) + "\n")
    return path


def new_figure(columns: int = 1, width: float = 5.5, height: float = 4.0):
    """A matplotlib figure with ``columns`` axes side by side (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, columns, figsize=(width * columns, height), squeeze=False)
    return figure, list(axes[0])
