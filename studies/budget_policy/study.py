#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Does picking the budget per image (`num_core_tokens="auto"`, `veca_hf.AdaptiveBudget`) beat fixed budgets?

For a distilled VECA, at every resolution of `--resolutions`, each fixed budget of the ladder and the policy fitted
for each target mean cost (FLOPs per image over the largest budget's, the first pass included; `--target_fractions`
of the way from the smallest budget's cost to 1) are compared on:

- accuracy: 20-NN (DINO's weighted vote) and a linear probe on the global feature, Fashion-MNIST test images, the
  reference images embedded the same way as the queries; paired-bootstrap intervals of policy minus fixed budget;
- fidelity: the mean cosine of the global feature to the largest budget's, on Fashion-MNIST and on crops of real
  photos held out from the fit;
- cost: the mean FLOPs (analytic, `veca_hf.flops`) relative to the largest budget, and the measured wall time per
  image of `model(pixel_values, num_core_tokens=...)` on `--timing_images` queries in batches of `--batch_size`
  (interleaved rounds, median), the policy's real cascade included.

An `oracle` row picks per image with the true distances (the same cascade and cost accounting): what any policy
reading the first pass could at best reach. The teacher's accuracy is the reference. The policy is fitted on
Fashion-MNIST training images and crops of the first half of the photos; nothing it is judged on.

    python studies/budget_policy/study.py --student outputs/demo/veca-student --teacher TEACHER_DIR \
        --fashion_mnist_dir FASHION_MNIST_DIR --photos_dir PHOTOS_DIR --results_dir studies/budget_policy/results

Writes `results.json`, `results.md` and `accuracy_vs_cost.png` to `--results_dir`.
"""

import argparse
import io
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import AutoModel

from veca_hf import AdaptiveBudget, VecaModel
from veca_hf.budget_policy import cascade_costs, ladder_for, relative_costs, threshold_for_cost
from veca_hf.demo.main_job import photo_crops
from veca_hf.evaluation import extract_features, fashion_mnist, preprocess_image, train_linear_classifier
from veca_hf.evaluation.knn import knn_classify
from veca_hf.evaluation.linear_probes import predict_classes
from veca_hf.evaluation.statistics import paired_bootstrap_interval
from veca_hf.model.image_budgets_veca import budget_policy_features, first_budget_within


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--student", required=True, help="A distilled VECA folder.")
    parser.add_argument("--teacher", default=None, help="The teacher's folder (reference accuracy), optional.")
    parser.add_argument("--fashion_mnist_dir", required=True)
    parser.add_argument("--photos_dir", required=True, help="A folder of real photos (JPEG / PNG).")
    parser.add_argument("--resolutions", default="112,224,448")
    parser.add_argument("--budgets", default=None, help="The ladder (default: 8,16,32,64 as the bank allows).")
    parser.add_argument(
        "--target_fractions",
        default="0.25,0.5,0.75",
        help="The policy's target mean costs, as fractions of the way from the smallest budget's cost (every image "
        "stops after the first pass) to the largest budget's (1).",
    )
    parser.add_argument("--num_fit", type=int, default=300, help="Fashion-MNIST training images to fit on.")
    parser.add_argument("--num_fit_crops", type=int, default=100, help="Photo crops to fit on.")
    parser.add_argument("--num_reference", type=int, default=1000, help="Labelled reference images (k-NN, probe).")
    parser.add_argument("--num_queries", type=int, default=500, help="Fashion-MNIST test queries.")
    parser.add_argument("--num_photo_crops", type=int, default=100, help="Held-out photo crops (fidelity).")
    parser.add_argument("--timing_images", type=int, default=128)
    parser.add_argument("--timing_rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--probe_steps", type=int, default=1000)
    parser.add_argument("--results_dir", default="studies/budget_policy/results")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def image_sets(args) -> dict[str, tuple[list[PIL.Image.Image], np.ndarray | None]]:
    """The PIL images of every role (and labels where there are): fit, reference, queries, photos."""
    train, test = fashion_mnist(args.fashion_mnist_dir, "train"), fashion_mnist(args.fashion_mnist_dir, "test")
    rng = np.random.default_rng(args.seed)
    photos = sorted(p for p in Path(args.photos_dir).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if len(photos) < 4:
        raise ValueError(f"--photos_dir {args.photos_dir} holds {len(photos)} photos; the study needs at least 4.")
    half = len(photos) // 2

    def crops(paths, count):
        views = []
        for index in range(count):
            with PIL.Image.open(paths[index % len(paths)]) as photo:
                view = photo_crops(photo.convert("RGB"), 2, rng, side=256)[1]  # a random crop
            views.append(PIL.Image.open(io.BytesIO(view)).convert("RGB"))
        return views

    fit_indices = rng.choice(len(train), size=args.num_fit, replace=False)
    # the reference and query images are the last of the test split (the main job's validation takes the first)
    end = len(test)
    reference = range(end - args.num_queries - args.num_reference, end - args.num_queries)
    queries = range(end - args.num_queries, end)
    return {
        "fit": ([train.image(int(i)) for i in fit_indices] + crops(photos[:half], args.num_fit_crops), None),
        "reference": ([test.image(i) for i in reference], test.labels[list(reference)]),
        "queries": ([test.image(i) for i in queries], test.labels[list(queries)]),
        "photos": (crops(photos[half:], args.num_photo_crops), None),
    }


@torch.inference_mode()
def embed(model: VecaModel, pixel_values: torch.Tensor, ladder: list[int], batch_size: int) -> dict:
    """Global features at every budget `{budget: (n, D)}` and the first pass's policy features `(n, F)`."""
    globals_, first = {budget: [] for budget in ladder}, []
    for chunk in pixel_values.split(batch_size):
        for budget in ladder:
            outputs = model(chunk, num_core_tokens=budget)
            globals_[budget].append(outputs.pooler_output.float())
            if budget == ladder[0]:
                first.append(budget_policy_features(outputs))
    return {"global": {b: torch.cat(v) for b, v in globals_.items()}, "first": torch.cat(first)}


def selected(globals_: dict, ladder: list[int], indices: torch.Tensor) -> torch.Tensor:
    """Each image's global feature at its picked budget: `(n, D)`."""
    stacked = torch.stack([globals_[budget] for budget in ladder], dim=1)  # (n, K, D)
    return stacked[torch.arange(len(indices)), indices]


def distances_to_largest(globals_: dict, ladder: list[int]) -> torch.Tensor:
    largest = globals_[ladder[-1]].double()
    return torch.stack([1 - torch.cosine_similarity(globals_[b].double(), largest) for b in ladder[:-1]], dim=1)


def accuracy(reference: torch.Tensor, reference_labels, queries: torch.Tensor, query_labels, args) -> dict:
    labels, query_labels = torch.as_tensor(reference_labels), torch.as_tensor(query_labels)
    knn = knn_classify(reference, labels, queries, num_classes=10, k=20) == query_labels
    probe = train_linear_classifier(reference, labels, 10, steps=args.probe_steps, seed=args.seed)
    linear = predict_classes(probe, queries) == query_labels
    return {"knn_correct": knn.numpy(), "linear_correct": linear.numpy()}


@torch.inference_mode()
@torch.inference_mode()
def wall_times(model: VecaModel, pixel_values: torch.Tensor, methods: dict, args) -> dict[str, float]:
    """Median seconds per image over interleaved rounds of `model(batch, num_core_tokens=...)` for each method
    (`{name: (num_core_tokens, policy dict or None, group_image_budgets)}`; a list of budgets is cycled over the
    images of each batch)."""
    rounds = {name: [] for name in methods}
    for round_index in range(args.timing_rounds + 1):  # the first round warms up
        for name, (budget, policy, group) in methods.items():
            model.config.adaptive_budget, model.config.group_image_budgets = policy, group
            start = time.perf_counter()
            for chunk in pixel_values.split(args.batch_size):
                per_image = [budget[i % len(budget)] for i in range(len(chunk))] if isinstance(budget, list) else None
                model(chunk, num_core_tokens=per_image or budget)
            if round_index:
                rounds[name].append((time.perf_counter() - start) / len(pixel_values))
    model.config.adaptive_budget, model.config.group_image_budgets = None, True
    return {name: statistics.median(times) for name, times in rounds.items()}


def study_resolution(model, teacher, sets, resolution: int, ladder: list[int], fractions: list[float], args) -> dict:
    pixels = {role: torch.stack([preprocess_image(image, resolution) for image in images])
              for role, (images, _) in sets.items()}  # fmt: skip
    embedded = {role: embed(model, values, ladder, args.batch_size) for role, values in pixels.items()}
    costs = relative_costs(model.config, resolution, resolution, ladder)
    targets = [round(float(costs[0] + fraction * (1 - costs[0])), 3) for fraction in fractions]
    fit = embedded["fit"]
    fit_distances = distances_to_largest(fit["global"], ladder)
    labels = {role: labels for role, (_, labels) in sets.items()}

    def evaluate(name: str, picks: dict[str, torch.Tensor], budget_costs: torch.Tensor, extra: dict) -> dict:
        features = {role: selected(embedded[role]["global"], ladder, picks[role]) for role in picks}
        scores = accuracy(features["reference"], labels["reference"], features["queries"], labels["queries"], args)
        fidelity = {
            role: float(torch.cosine_similarity(features[role], embedded[role]["global"][ladder[-1]]).mean())
            for role in ("queries", "photos")
        }
        counts = {b: int((picks["queries"] == k).sum()) for k, b in enumerate(ladder)}
        return {"method": name, "mean_cost": float(budget_costs.mean()), "fidelity": fidelity,
                "budget_counts": counts, **scores, **extra}  # fmt: skip

    rows = []
    for index, budget in enumerate(ladder):
        picks = {role: torch.full((len(pixels[role]),), index) for role in ("reference", "queries", "photos")}
        rows.append(evaluate(f"C = {budget}", picks, costs[index : index + 1], {"budget": budget}))
    policies = {}
    for target in targets:
        policy = AdaptiveBudget.from_training_data(fit["first"], fit_distances, ladder, costs, target, seed=args.seed)
        picks = {role: torch.tensor([ladder.index(b) for b in policy.pick(embedded[role]["first"])])
                 for role in ("reference", "queries", "photos")}  # fmt: skip
        rows.append(evaluate(f"policy @ {target}", picks, cascade_costs(picks["queries"], costs),
                             {"target": target, "fitted_mean_cost": policy.mean_cost}))  # fmt: skip
        policies[target] = policy
        # the oracle: true distances, a threshold for the same target on the fit images
        threshold, _ = threshold_for_cost(fit_distances, costs, target)
        picks = {role: first_budget_within(distances_to_largest(embedded[role]["global"], ladder), threshold)
                 for role in ("reference", "queries", "photos")}  # fmt: skip
        rows.append(evaluate(f"oracle @ {target}", picks, cascade_costs(picks["queries"], costs), {"target": target}))

    # wall time of the real calls, the policy's cascade included; its picks checked against the simulated ones
    timing = pixels["queries"][: args.timing_images]
    methods = {f"C = {b}": (b, None, True) for b in ladder}
    methods.update({f"policy @ {t}": ("auto", policy.__dict__, True) for t, policy in policies.items()})
    # a batch whose images cycle through every budget of the ladder: by budget groups, or masked at the largest
    methods.update({"every budget, grouped": (ladder, None, True), "every budget, masked": (ladder, None, False)})
    seconds = wall_times(model, timing, methods, args)
    for target, policy in policies.items():
        model.config.adaptive_budget = policy.__dict__
        with torch.inference_mode():
            picked = torch.cat([model(c, num_core_tokens="auto").core_mask.sum(1) for c in timing.split(64)])
        model.config.adaptive_budget = None
        simulated = torch.tensor(policy.pick(embedded["queries"]["first"][: len(timing)]))
        if not torch.equal(picked.cpu(), simulated):
            raise RuntimeError(f"policy @ {target}: the model's picks differ from the policy's own")
    for row in rows:
        row["seconds_per_image"] = seconds.get(row["method"])

    teacher_row = None
    if teacher is not None:
        with torch.no_grad():
            features = {role: torch.cat([extract_features(teacher, c)[0] for c in pixels[role].split(args.batch_size)])
                        for role in ("reference", "queries")}  # fmt: skip
        teacher_row = accuracy(
            features["reference"], labels["reference"], features["queries"], labels["queries"], args
        )
    result = summarise(rows, teacher_row, resolution, costs, ladder)
    mixed_cost = float(costs.mean())  # images cycle through the ladder
    result["mixed_batch"] = {
        "budgets": ladder,
        "mean_cost": mixed_cost,
        "seconds_per_image": {name: seconds[name] for name in ("every budget, grouped", "every budget, masked")},
        "largest_budget_seconds_per_image": seconds[f"C = {ladder[-1]}"],
    }
    return result


def summarise(rows: list[dict], teacher_row: dict | None, resolution: int, costs, ladder) -> dict:
    """Accuracies with paired-bootstrap intervals against the fixed budgets, JSON-ready."""
    fixed = [row for row in rows if "budget" in row]
    out = []
    for row in rows:
        entry = {k: v for k, v in row.items() if not k.endswith("_correct")}
        for metric in ("knn", "linear"):
            entry[f"{metric}_accuracy"] = float(row[f"{metric}_correct"].mean())
        if "budget" not in row:  # against every fixed budget: policy minus fixed, 95% paired bootstrap
            entry["knn_minus_fixed"] = {
                str(other["budget"]): {
                    "difference": float(row["knn_correct"].mean() - other["knn_correct"].mean()),
                    "interval": paired_bootstrap_interval(
                        lambda a, b: a - b, row["knn_correct"], other["knn_correct"]
                    ),
                }
                for other in fixed
            }
        out.append(entry)
    teacher = None
    if teacher_row is not None:
        teacher = {f"{m}_accuracy": float(teacher_row[f"{m}_correct"].mean()) for m in ("knn", "linear")}
    relative = dict(zip(map(str, ladder), costs.tolist(), strict=True))
    return {"resolution": resolution, "relative_costs": relative, "rows": out, "teacher": teacher}


def markdown(result: dict) -> str:
    lines = [f"# Budget per image vs fixed budgets\n\n{result['machine']}\n\n`{result['command']}`\n"]
    for block in result["resolutions"]:
        lines.append(f"\n## {block['resolution']} px\n")
        if block["teacher"]:
            lines.append(f"Teacher: 20-NN {100 * block['teacher']['knn_accuracy']:.1f}%, linear "
                         f"{100 * block['teacher']['linear_accuracy']:.1f}%.\n")  # fmt: skip
        lines.append("| method | mean cost | ms / image | 20-NN % | linear % | fidelity (FMNIST / photos) | budgets |")
        lines.append("|---|---|---|---|---|---|---|")
        for row in block["rows"]:
            ms = f"{1000 * row['seconds_per_image']:.2f}" if row.get("seconds_per_image") else "-"
            counts = ", ".join(f"{b}: {n}" for b, n in row["budget_counts"].items() if n)
            lines.append(
                f"| {row['method']} | {row['mean_cost']:.3f} | {ms} | {100 * row['knn_accuracy']:.1f} | "
                f"{100 * row['linear_accuracy']:.1f} | {row['fidelity']['queries']:.4f} / "
                f"{row['fidelity']['photos']:.4f} | {counts} |"
            )
        mixed = block["mixed_batch"]
        times = mixed["seconds_per_image"]
        lines.append(
            f"\nA batch cycling through budgets {mixed['budgets']} (mean cost {mixed['mean_cost']:.3f}): by budget "
            f"groups {1000 * times['every budget, grouped']:.2f} ms / image, masked at the largest budget "
            f"{1000 * times['every budget, masked']:.2f}, every image at the largest budget "
            f"{1000 * mixed['largest_budget_seconds_per_image']:.2f}.\n"
        )
        lines.append("\nPolicy minus fixed budget, 20-NN points (95% paired bootstrap):\n")
        for row in block["rows"]:
            if row["method"].startswith("policy"):
                cells = [f"C = {b}: {100 * d['difference']:+.1f} [{100 * d['interval'][0]:+.1f}, "
                         f"{100 * d['interval'][1]:+.1f}]" for b, d in row["knn_minus_fixed"].items()]  # fmt: skip
                lines.append(f"- {row['method']}: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = result["resolutions"]
    figure, axes = plt.subplots(1, len(blocks), figsize=(4.5 * len(blocks), 3.6), squeeze=False)
    for axis, block in zip(axes[0], blocks, strict=True):
        for prefix, style in (("C = ", "o-"), ("policy", "s--"), ("oracle", "^:")):
            rows = sorted((r for r in block["rows"] if r["method"].startswith(prefix)), key=lambda r: r["mean_cost"])
            label = {"C = ": "fixed budgets", "policy": "policy (first pass counted)", "oracle": "oracle"}[prefix]
            axis.plot([r["mean_cost"] for r in rows], [100 * r["knn_accuracy"] for r in rows], style, label=label)
        axis.set(title=f"{block['resolution']} px", xlabel="mean FLOPs / largest budget's", ylabel="20-NN accuracy %")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def command_line(args) -> str:
    """The command as run, with this machine's paths named by what they are."""
    words = ["python", "studies/budget_policy/study.py"]
    for name, value in vars(args).items():
        placeholder = {"student": "STUDENT_DIR", "teacher": "TEACHER_DIR", "fashion_mnist_dir": "FASHION_MNIST_DIR",
                       "photos_dir": "PHOTOS_DIR"}.get(name)  # fmt: skip
        if value is not None and (placeholder or value != parse_args(REQUIRED_FOR_DEFAULTS).__dict__[name]):
            words += [f"--{name}", placeholder or str(value)]
    return " ".join(words)


REQUIRED_FOR_DEFAULTS = ["--student", "-", "--fashion_mnist_dir", "-", "--photos_dir", "-"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = VecaModel.from_pretrained(args.student).eval()
    teacher = AutoModel.from_pretrained(args.teacher).eval() if args.teacher else None
    ladder = ladder_for(model.config, [int(b) for b in args.budgets.split(",")] if args.budgets else None)
    sets = image_sets(args)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "command": command_line(args),
        "ladder": ladder,
        "resolutions": [],
    }
    for resolution in [int(r) for r in args.resolutions.split(",")]:
        started = time.perf_counter()
        fractions = [float(f) for f in args.target_fractions.split(",")]
        result["resolutions"].append(study_resolution(model, teacher, sets, resolution, ladder, fractions, args))
        print(f"{resolution} px done in {time.perf_counter() - started:.0f} s", flush=True)
        (results_dir / "results.json").write_text(json.dumps(result, indent=2))  # each resolution kept as it ends
    (results_dir / "results.md").write_text(markdown(result))
    plot(result, results_dir / "accuracy_vs_cost.png")
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
