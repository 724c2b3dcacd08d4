"""Does training with 8-bit compressed checkpoints reach the accuracy of plain PyTorch?

Trains the same small ResNet (bench/models.py, CIFAR-style pre-activation bottleneck,
one input channel) from the same initial weights, on the same batches in the same
order, with plain PyTorch and with actsave's int8 and fp8 checkpoints, on
scikit-learn's bundled 8x8 handwritten digits (``sklearn.datasets.load_digits``,
offline) upscaled to 16x16. Prints the test accuracy of each (the goal: within 1
point of plain PyTorch) and plots the training loss curves to a PNG.

A mode this version of actsave cannot build stops the run with an error naming it.
About 80 s on two CPU cores.

    python bench/accuracy_parity.py
    python bench/accuracy_parity.py --epochs 10 --depth 29
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import harness
from models import cifar_resnet

PROVIDERS = ("torch", "actsave_int8", "actsave_fp8")
NUM_CLASSES = 10
TEST_FRACTION = 0.2
PARITY_POINTS = 1.0  # the goal: accuracies within this many percentage points


def load_digits(image_size: int, limit: Optional[int] = None) -> tuple:
    """``(train, test)``, each ``(images, labels)``: the digits standardized and
    upscaled to ``image_size`` x ``image_size``, split after a seeded shuffle."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(harness.SEED))[:limit]
    images, labels = images[order], labels[order]
    images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    images = (images - images.mean()) / images.std()
    n_test = int(len(labels) * TEST_FRACTION)
    return (images[n_test:], labels[n_test:]), (images[:n_test], labels[:n_test])


def train(model, data: tuple, epochs: int, batch: int, lr: float, progress: harness.Progress) -> list:
    """SGD with momentum; returns the loss of every step. The batch order depends only
    on the seed, so every provider sees the same batches."""
    images, labels = data
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    order = torch.Generator().manual_seed(harness.SEED)
    losses = []
    model.train()
    for _ in range(epochs):
        for index in torch.randperm(len(labels), generator=order).split(batch):
            loss = F.cross_entropy(model(images[index]), labels[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        progress.describe(f"loss {losses[-1]:.3f}")
        progress.advance()
    return losses


@torch.no_grad()
def accuracy(model, data: tuple) -> float:
    images, labels = data
    model.eval()
    return 100.0 * (model(images).argmax(1) == labels).float().mean().item()


def plot_losses(curves: dict, title: str, path: Path) -> Optional[str]:
    """Training loss per step, one line per provider. Returns a note when it cannot,
    else None."""
    plt = harness.pyplot()
    if plt is None:
        return harness.MATPLOTLIB_MISSING
    fig, axes = plt.subplots(figsize=(7, 4.5))
    for name, losses in curves.items():
        axes.plot(losses, label=name, alpha=0.8)
    axes.set(xlabel="step", ylabel="training loss", yscale="log", title=title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    harness.save_figure(fig, path)
    return None


def parse_arguments(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6, help="training epochs (default: 6)")
    parser.add_argument("--depth", type=int, default=20, help="ResNet depth, 9n + 2 (default: 20)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default: 64)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--image-size", type=int, default=16, help="digits are upscaled to this (default: 16)")
    parser.add_argument("--out", type=Path, default=harness.RESULTS_DIR / "cpu-accuracy_parity.png",
                        help="PNG of the loss curves (default: bench/results/cpu-accuracy_parity.png)")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op CPU threads, 0 for PyTorch's default (default: 1, steadiest on a shared CPU)")
    parser.add_argument("--smoke", action="store_true", help="ResNet-11, one epoch on 128 digits, for the tests")
    return parser.parse_args(argv)


def train_each_provider(base, train_data, test_data, epochs: int, args) -> tuple:
    """``(curves, accuracies, notes)``: per available provider, the loss of every
    step and the test accuracy of a deep copy of ``base`` trained on ``train_data``."""
    names, notes = harness.available_providers(list(PROVIDERS))
    curves, accuracies = {}, {}
    progress = harness.Progress(len(names) * epochs, "accuracy parity")
    for name in names:
        model = harness.PROVIDERS[name].build(copy.deepcopy(base), None, None)  # no planned provider here
        curves[name] = train(model, train_data, epochs, args.batch, args.lr, progress)
        accuracies[name] = accuracy(model, test_data)
    progress.close()
    return curves, accuracies, notes


def print_report(curves: dict, accuracies: dict, epochs: int) -> None:
    reference = accuracies[harness.REFERENCE]
    steps_per_epoch = len(curves[harness.REFERENCE]) // epochs
    print(f"{'provider':<14} {'test acc %':>10} {'vs torch':>9} {'last-epoch loss':>16}")
    for name, acc in accuracies.items():
        last_epoch = sum(curves[name][-steps_per_epoch:]) / steps_per_epoch
        print(f"{name:<14} {acc:>10.2f} {acc - reference:>+9.2f} {last_epoch:>16.4f}")
    worst = max(abs(acc - reference) for acc in accuracies.values())
    print(f"largest gap to torch: {worst:.2f} points (goal: within {PARITY_POINTS:g})")


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    epochs, limit, depth = (1, 128, 11) if args.smoke else (args.epochs, None, args.depth)
    train_data, test_data = load_digits(args.image_size, limit)
    torch.manual_seed(harness.SEED)
    base = cifar_resnet(depth, num_classes=NUM_CLASSES, in_channels=1)
    curves, accuracies, notes = train_each_provider(base, train_data, test_data, epochs, args)

    print(f"ResNet-{depth} on digits {args.image_size}x{args.image_size}, {epochs} epochs, "
          f"{len(train_data[1])} train / {len(test_data[1])} test")
    print_report(curves, accuracies, epochs)
    plot_note = plot_losses(curves, f"ResNet-{depth} on upscaled digits", args.out)
    for note in notes + ([plot_note] if plot_note else []):
        print(f"note: {note}")
    if not plot_note:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
