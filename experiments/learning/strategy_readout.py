"""Is the case's optimal strategy in the policy's hidden state where it names the strategy?

A linear read-out test: for ``--cases`` training cases, the hidden state of every layer at the
position where a plan writes its strategy (the case's prompt, then a fixed one-group plan up to
``"strategy": "``), and the 5-fold cross-validated accuracy of a multinomial logistic regression
(standardised features) predicting the case's optimal strategy from it, beside the majority
class. High accuracy with a case-blind policy means the information is there and only the output
layer's read-out is missing (experiments/learning/NOTEBOOK.md).

    OMP_NUM_THREADS=1 python experiments/learning/strategy_readout.py --checkpoint runs/learn/stage0
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from orthojob.core.prompts import build_messages, prompt_format_of, reset_observation
from orthojob.modeling import models
from orthojob.rewards.strategy_advantage import STRATEGY_KEY
from server.cases import TRAIN_SEED_START, generate_case
from server.clinical_profiles import STRATEGIES

PLAN_PREFIX = (
    '{"tooth_groups": [{"teeth": [11, 21], "fraction": 1.0, "priority": 1, "start_stage": 1}], '
    + STRATEGY_KEY
)


def hidden_states(checkpoint: str, task_id: str, n: int, seed0: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Per layer (embeddings first) an (n, hidden) array, and the (n,) optimal-strategy index."""
    model, tokenizer = models.load_policy(checkpoint, lora_r=0, max_seq_length=4096)
    model.eval()
    fmt = prompt_format_of(model)
    layers: list[list[np.ndarray]] = []
    labels = []
    with torch.inference_mode():
        for seed in range(seed0, seed0 + n):
            messages = build_messages(reset_observation(seed, task_id, False), fmt)
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(prompt + PLAN_PREFIX, return_tensors="pt", add_special_tokens=False)["input_ids"]
            out = model(input_ids=ids, output_hidden_states=True)
            if not layers:
                layers = [[] for _ in out.hidden_states]
            for k, h in enumerate(out.hidden_states):
                layers[k].append(h[0, -1].float().numpy())
            labels.append(STRATEGIES.index(generate_case(task_id, seed, False).optimal_strategy))
    return [np.stack(x) for x in layers], np.array(labels)


def _fit(x: torch.Tensor, y: torch.Tensor, l2: float, epochs: int) -> torch.nn.Linear:
    linear = torch.nn.Linear(x.shape[1], len(STRATEGIES))
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=epochs)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(linear(x), y) + l2 * linear.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return linear


def cv_accuracy(x: np.ndarray, y: np.ndarray, folds: int = 5, l2: float = 1e-2, epochs: int = 300) -> float:
    """Mean held-out accuracy of a multinomial logistic regression over ``folds`` folds."""
    order = np.random.default_rng(0).permutation(len(y))
    hits = []
    for f in range(folds):
        test = order[f::folds]
        train = np.setdiff1d(order, test)
        mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
        xt = torch.tensor((x[train] - mu) / sd, dtype=torch.float32)
        xv = torch.tensor((x[test] - mu) / sd, dtype=torch.float32)
        linear = _fit(xt, torch.tensor(y[train]), l2, epochs)
        with torch.no_grad():
            hits.extend((linear(xv).argmax(1).numpy() == y[test]).tolist())
    return float(np.mean(hits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a model folder (stage 0, GRPO, the base model)")
    parser.add_argument("--cases", type=int, default=400, help="training cases to read (default 400)")
    parser.add_argument("--task-id", default="task_easy")
    parser.add_argument("--seed-start", type=int, default=TRAIN_SEED_START + 100_000)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, y = hidden_states(args.checkpoint, args.task_id, args.cases, args.seed_start)
    result = {
        "checkpoint": args.checkpoint,
        "cases": args.cases,
        "majority": float(np.bincount(y).max() / len(y)),
        "accuracy_by_layer": [round(cv_accuracy(x, y), 3) for x in layers],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
