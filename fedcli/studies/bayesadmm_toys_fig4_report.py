"""BayesADMM toys, Fig. 4's report section: the decision-line figure, the tables and the checks.

Part of the `bayesadmm_toys` study (fedcli.studies.bayesadmm_toys: the paper, the deviations, `run`).
The numbers it reports (`fig4_numbers`: the toy's data, client solvers, targets and metrics) are
computed in fedcli.studies.bayesadmm_toys_fig4.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.studies.bayesadmm_toys_fig4 import BOUNDARY_TOL, FIG4_WINDOW, fig4_bayes_config, fig4_numbers
from fedcli.studies.bayesadmm_toys_shared import (
    Sizes,
    cell,
    first_round,
    semilogy,
)
from fedcli.studies.common import check_line, markdown_table, save_figure
from fedcli.tracking.report.plots import figure


def plot_boundaries(
    ax: Any,
    clients: list[tuple[np.ndarray, np.ndarray]],
    thetas: list[np.ndarray],
    target: np.ndarray,
    title: str,
) -> None:
    """Fig. 4's picture: both clients' points and the server's decision lines theta^T [x, 1] = 0 per iteration."""
    from matplotlib import colormaps

    for c, (x, y) in enumerate(clients):
        for label, marker in ((1, "o"), (0, "s")):
            pts = x[y == label]
            ax.scatter(
                pts[:, 0],
                pts[:, 1],
                s=12,
                marker=marker,
                alpha=0.6,
                rasterized=True,
                color=("#6AC1DE", "#CF7A7A")[c] if label else ("#1565C0", "#8B2E2E")[c],
            )
    xs = np.linspace(*FIG4_WINDOW[:2], 50)
    for r, theta in enumerate(thetas, start=1):
        ax.plot(
            xs,
            -(theta[0] * xs + theta[2]) / theta[1],
            color=colormaps["viridis"](0.9 - 0.8 * (r - 1) / max(len(thetas) - 1, 1)),  # light to dark
            lw=1.2,
            label=f"iter {r}",
        )
    ax.plot(xs, -(target[0] * xs + target[2]) / target[1], "r--", lw=1.5, label="target")
    ax.set_xlim(FIG4_WINDOW[:2])
    ax.set_ylim(FIG4_WINDOW[2:])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="lower right", ncol=2)


def spread(values: list[float]) -> str:
    """median [min, max] of the MC runs."""
    return f"{np.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def reach_text(count: int | None) -> str:
    return "—" if count is None else str(count)


def fig4_rows(n: dict[str, Any]) -> list[list[Any]]:
    """One row per server iteration."""
    rounds = max(len(n["admm"]), len(n["mc"][0]))

    def mc(key: str, r: int) -> str:  # the MC runs' spread at round r, "—" past their last round
        return spread([run[r] for run in n[key]]) if r < len(n["mc"][0]) else "—"

    return [
        [
            r + 1,
            cell(n["admm_rel"], r),
            cell(n["admm_area"], r),
            mc("mc_rel", r),
            mc("mc_area", r),
            mc("mc_prec", r),
            cell(n["laplace_rel"], r),
            cell(n["laplace_area"], r),
            cell(n["laplace_prec"], r),
        ]
        for r in range(rounds)
    ]


def fig4_figure(n: dict[str, Any], out: Path) -> str:
    """Server lines per iteration for ADMM and one MC run of BayesADMM, and the disagreement curves."""
    fig = figure(15.0, 4.2)
    axes = fig.subplots(1, 3)
    plot_boundaries(axes[0], n["clients"], n["admm"], n["map"], "FederatedADMM server (target: MAP)")
    plot_boundaries(
        axes[1], n["clients"], [m for m, _ in n["mc"][0]], n["vb"], "BayesADMM server, MC run 0 (target: VB)"
    )
    for i, area in enumerate(n["mc_area"]):
        axes[2].semilogy(
            range(1, len(area) + 1),
            np.maximum(area, 1e-4),
            "b-",
            alpha=0.5,
            label="BayesADMM, MC runs" if i == 0 else None,
        )
    semilogy(
        axes[2],
        {"FederatedADMM": n["admm_area"], "BayesADMM, delta method": n["laplace_area"]},
        1e-4,
        {"FederatedADMM": "ks-", "BayesADMM, delta method": "g^--"},
    )
    axes[2].axhline(BOUNDARY_TOL, color="r", ls=":", lw=1)
    axes[2].set_ylabel("boundary disagreement (fraction of window)")
    return save_figure(fig, out, "fig4")


def fig4_checks(n: dict[str, Any], reach: dict[str, Any], sizes: Sizes) -> list[str]:
    """The claims of Fig. 4, computed, and a reading of why they hold or not."""
    admm_reach, mc_reach, laplace_reach = reach["admm"], reach["mc"], reach["laplace"]
    ordered = sorted(math.inf if c is None else c for c in mc_reach)
    first = [area[0] for area in n["mc_area"]]
    best = int(np.argmin(n["admm_area"]))
    hp = fig4_bayes_config(1)
    moved = sum(hp.step_size / (1 + hp.step_decay * t) for t in range(sizes.fig4_von_steps))
    return [
        check_line(
            "FederatedADMM's server reaches the optimum's decision boundary at iteration 5 (Fig. 4)",
            admm_reach == 5,
            f"first iteration within tolerance: {reach_text(admm_reach)}",
        ),
        check_line(
            "BayesADMM (the authors' schedule, 1 MC sample) reaches it by iteration 2 in every run (Fig. 4)",
            all(c is not None and c <= 2 for c in mc_reach),
            "per run: " + ", ".join(reach_text(c) for c in mc_reach),
        ),
        check_line(
            "BayesADMM with the delta method (no MC noise) reaches it by iteration 2",
            laplace_reach is not None and laplace_reach <= 2,
            f"first iteration: {reach_text(laplace_reach)}",
        ),
        check_line(
            "BayesADMM needs fewer server iterations than FederatedADMM (median over MC runs)",
            ordered[len(ordered) // 2] < (math.inf if admm_reach is None else admm_reach),
            f"median {ordered[len(ordered) // 2]} vs {reach_text(admm_reach)}",
        ),
        check_line(
            "After one round BayesADMM's decision line is closer to its target than ADMM's, in every run "
            '("adapts in a single round")',
            max(first) < n["admm_area"][0],
            f"boundary disagreement {min(first):.4f}-{max(first):.4f} vs {n['admm_area'][0]:.4f}",
        ),
        "",
        f"**Reading.** With the authors' schedule a client solve is far from exact: Sum_t b_S,t = {moved:.3f}, so "
        "each VON run moves the client precision only about that fraction of the way from S_bar to its fixed "
        "point, and after 2 server iterations the server precision is still "
        f"{np.median([run[1] for run in n['mc_prec']]):.0%} (median) away from the VB precision. The means "
        "adapt faster (the mean step is preconditioned by the small S), which is why BayesADMM's line is already "
        "close after one round, but whether it is within the tolerance by iteration 2 depends on the MC draws "
        "(the toy's torch RNG is unseeded, so the published figure shows one unknown draw). ADMM's line is "
        f"closest to the MAP's at iteration {best + 1} (Fig. 4 draws iterations 1, 3, 5), where its parameters "
        f"are still {n['admm_rel'][best]:.0%} off; at iteration {len(n['admm'])} the line disagrees on "
        f"{n['admm_area'][-1]:.2%} of the window and the parameters are {n['admm_rel'][-1]:.0%} off.",
    ]


def fig4_section(out: Path, sizes: Sizes) -> list[str]:
    """Fig. 4: 2-D logistic regression with an outlier cluster, FederatedADMM vs full-covariance BayesADMM."""
    n = fig4_numbers(sizes)
    reach: dict[str, Any] = {
        "admm": first_round(n["admm_area"], BOUNDARY_TOL),
        "mc": [first_round(a, BOUNDARY_TOL) for a in n["mc_area"]],
        "laplace": first_round(n["laplace_area"], BOUNDARY_TOL),
    }
    reach_rows = [
        ["FederatedADMM", reach_text(reach["admm"]), reach_text(first_round(n["admm_rel"], 0.1))],
        [
            "BayesADMM, 1 MC sample (per run)",
            ", ".join(reach_text(c) for c in reach["mc"]),
            ", ".join(reach_text(first_round(a, 0.1)) for a in n["mc_rel"]),
        ],
        [
            "BayesADMM, delta method",
            reach_text(reach["laplace"]),
            reach_text(first_round(n["laplace_rel"], 0.1)),
        ],
    ]
    steps = n["admm_steps"]
    return [
        "## Fig. 4: 2-D classification with an outlier",
        "",
        "**Claim (§4, Fig. 4).** With K = 2 clients (one holds an outlier cluster), delta = rho = 0.2 for both "
        'methods, "the server ... with ADMM takes 5 iterations while with Bayes only needs 2"; BayesADMM "quickly '
        'adapts in a single round".',
        "",
        "**Setup.** The released toy's data (103 + 200 points, features [x1, x2, 1], seeded as in the script, "
        "so the authors' points) and its client solvers: FederatedADMM with heavy-ball GD (lr 1e-3, momentum 0.8, "
        f"<= {sizes.fig4_admm_max_steps} steps, stop at gradient norm < 1e-3; the solves took {min(steps)}-"
        f"{max(steps)} steps); full-covariance BayesADMM with {sizes.fig4_von_steps} VON steps b_S = 0.001 / "
        "(1 + 0.1 t), b_m = 2 b_S (lr_S = 0.005, lr_m = 0.01 on the summed loss), one MC sample per step "
        f"({sizes.fig4_mc_runs} runs, numpy default_rng(0)) and, as a deterministic variant, the delta method; "
        "server start S = I as in the toy; server steps by `bayesadmm_full.server_update` and "
        "`fedadmm.server_update`. Targets: MAP theta* of Sum l_k + delta/2 ||theta||^2 for ADMM and the "
        "delta method, the Gaussian VB optimum (Eq. 3) for MC BayesADMM. Reached = the server's decision line "
        f"differs from the target's on <= {BOUNDARY_TOL:.0%} of the plotted window x1 in [-6, 7], x2 in [-3, 2] "
        "(our threshold: the paper judges the figure by eye). For scale: the MAP and VB lines differ on "
        f"{n['map_vs_vb']:.2%} of it.",
        "",
        f"theta* = ({', '.join(f'{t:.4f}' for t in n['map'])}); VB mean = ({', '.join(f'{t:.4f}' for t in n['vb'])}).",
        "",
        *markdown_table(
            [
                "iter",
                "ADMM err",
                "ADMM boundary",
                "Bayes MC err",
                "Bayes MC boundary",
                "Bayes MC prec. err",
                "Bayes delta err",
                "Bayes delta boundary",
                "Bayes delta prec. err",
            ],
            fig4_rows(n),
        ),
        "",
        "err = ||theta_bar - target|| / ||target||; boundary = fraction of the window where the decisions differ; "
        "prec. err = ||S_bar - S*|| / ||S*|| (S* the VB precision, or the Laplace precision at theta*); MC columns: "
        "median [min, max] over the runs; — = not run.",
        "",
        *markdown_table(
            ["method", f"iterations to boundary <= {BOUNDARY_TOL:.0%}", "iterations to err <= 10%"],
            reach_rows,
        ),
        "",
        f"![decision lines per server iteration and the boundary disagreement]({fig4_figure(n, out)})",
        "",
        *fig4_checks(n, reach, sizes),
    ]
