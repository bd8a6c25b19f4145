"""FedAvg against FedPA on the bundled FEMNIST writers, from Python (docs/python-api.md).

    python examples/python_api.py                          # 30 rounds each, MLflow on: a few minutes on 2 cores
    python examples/python_api.py --rounds 3 --no-mlflow   # a quick look

Both runs land in the results store under --root (and in MLflow unless --no-mlflow), like runs
of `fedcli train`: `fedcli list runs --root ROOT` shows them, `fedcli ui --root ROOT` browses them.
The settings are the demo's (`fedcli demo`; FedPA Table 4's optimisers, scaled down).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fedcli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="communication rounds of each run (default 30)")
    parser.add_argument("--root", default="fedcli-runs", help="folder of the stores (default ./fedcli-runs)")
    parser.add_argument("--no-mlflow", action="store_true", help="log to the SQL store only")
    args = parser.parse_args()

    common = dict(task="femnist", rounds=args.rounds, clients_per_round=10, local_epochs=5, client_lr=0.05,
                  client_momentum=0.9, server_opt="momentum", server_lr=0.5, root=args.root,
                  experiment="python-api", no_mlflow=args.no_mlflow)
    fedavg = fedcli.train(algo="fedavg", **common)
    fedpa = fedcli.train(algo="fedpa", hp={"rho": 0.1, "burn_in_rounds": max(1, args.rounds // 3)}, **common)

    for run in (fedavg, fedpa):
        frame = run.metrics()  # one row per round, one column per metric
        print(f"{run.config['algorithm']['name']:<7} run {run.id[:8]}: test accuracy "
              f"{frame['eval/accuracy'].iloc[-1]:.4f} after {frame.index.max()} rounds")

    net = fedpa.model()  # the trained global model, an nn.Module taking the stored images
    with torch.no_grad():
        print(f"fedpa's model on 4 test images: logits of shape {tuple(net(torch.zeros(4, 28, 28, dtype=torch.uint8)).shape)}")

    out = Path(args.root) / "python-api-report.md"
    fedcli.report(runs=[fedavg, fedpa], output=out)  # the markdown and its PNG curves beside it
    print(f"report: {out}")


if __name__ == "__main__":
    main()
