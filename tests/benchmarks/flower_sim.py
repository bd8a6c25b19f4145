"""Flower's simulation engine on the bundled FEMNIST writers (run by tests/benchmarks/run.py).

flwr's legacy `start_simulation` (Ray backend, one Ray actor per concurrently running client,
`client_resources={"num_cpus": 1}`), its FedAvg strategy with no evaluation, C of the 105
writers per round, 1 local epoch of SGD (lr 0.01, batch 20) in a NumPyClient written as the
Flower tutorials write it. Data are decoded once per actor process (fedcli's FEMNIST cache).
Round times are taken between successive `aggregate_fit` returns; the first round's start
(`configure_fit` of round 1) against the parent's launch time gives Flower's start-up.

Needs flwr[simulation] (the `[bench]` extra); it pins older typer/rich/protobuf than fedcli,
so `make bench` runs it from its own environment (.venv-flower) when this one lacks flwr.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

LR, BATCH = 0.01, 20


def femnist():  # noqa: ANN201 - (task, xs, ys), decoded once per process
    import fedcli.datasets.bundled.femnist as module  # a real module: its attributes survive Ray's pickling
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.tasks import TaskOptions

    cached = getattr(module, "_bench_cache", None)
    if cached is None:
        task = TASKS["femnist"]
        data = task.load(TaskOptions())
        cached = (
            task,
            [task.prepare(data.x[ix]) for ix in data.client_indices],
            [data.y[ix] for ix in data.client_indices],
        )
        module._bench_cache = cached  # per Ray actor process: decoded once, reused by every client call
    return cached


def make_client(model_name: str, cid: int):  # noqa: ANN201
    import flwr as fl

    task, xs, ys = femnist()

    class FemnistClient(fl.client.NumPyClient):
        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            model = task.models[model_name]()
            state = {k: torch.from_numpy(v) for k, v in zip(model.state_dict(), parameters, strict=True)}
            model.load_state_dict(state)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            x, y = xs[cid], ys[cid]
            order = torch.randperm(len(y))
            for step, first in enumerate(range(0, len(y), BATCH)):
                idx = order[first : first + BATCH]
                opt.zero_grad()
                F.cross_entropy(model(x[idx], key=torch.tensor(step)), y[idx]).backward()
                opt.step()
            return [v.detach().numpy() for v in model.state_dict().values()], len(y), {}

    return FemnistClient().to_client()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--t0", type=float, default=time.time())
    args = parser.parse_args()

    import flwr as fl
    from flwr.common import ndarrays_to_parameters

    task, xs, _ = femnist()
    num_clients = len(xs)
    torch.manual_seed(0)
    init = [v.numpy() for v in task.models[args.model]().state_dict().values()]
    marks: dict[str, list[float]] = {"configure": [], "aggregate": []}

    class TimedFedAvg(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
            marks["configure"].append(time.time())
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
            out = super().aggregate_fit(server_round, results, failures)
            marks["aggregate"].append(time.time())
            return out

    strategy = TimedFedAvg(
        fraction_fit=args.clients_per_round / num_clients,
        min_fit_clients=args.clients_per_round,
        min_available_clients=num_clients,
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        initial_parameters=ndarrays_to_parameters(init),
    )
    fl.simulation.start_simulation(
        client_fn=lambda context: make_client(args.model, int(context.node_config["partition-id"])),
        num_clients=num_clients,
        config=fl.server.ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1, "num_gpus": 0.0},
        ray_init_args={"include_dashboard": False, "ignore_reinit_error": True},
    )
    ends = marks["aggregate"]
    starts = [marks["configure"][0], *ends[:-1]]
    args.out.write_text(
        json.dumps(
            {
                "round_s": [e - s for s, e in zip(starts, ends, strict=True)],
                "startup_s": marks["configure"][0] - args.t0,
                "flwr": fl.__version__,
                "cohort_examples_mean": float(np.mean([len(x) for x in xs])) * args.clients_per_round,
            }
        )
    )


if __name__ == "__main__":
    main()
