"""The methods' recipes: each method's settings as tuned on the reference task (2 workers; see
docs/results/which-recipe.md), shared by ``ds-lowcomm compare`` (which trains with them), the planner (which
prices them) and the benchmarks. ``configs/*.json`` are the same recipes as DeepSpeed configs users
copy (tests/test_configs_shipped.py keeps them equal)."""

from __future__ import annotations

MTDAO_PUBLISHED = {"method": "mtdao", "sync_every": 32, "momentum_betas": [0.999], "momentum_weights": [0.98],
                   "beta2": 0.999, "warm_betas": [0.9, 0.999], "switch_lr_scale": 4.0}
# The recipe compare ran for mtdao before issue 43 (configs/mtdao_two_momenta.json): a fast and a slow
# momentum (0.9 and 0.999 weighted 0.5 and 0.3) from step 1, beta2 the spec's, no warm start, lr 2e-3.
MTDAO_TWO_MOMENTA = {"method": "mtdao", "sync_every": 32, "momentum_betas": [0.9, 0.999],
                     "momentum_weights": [0.5, 0.3]}

# The reference task's recipe per method: learning rate of the per-step (or inner) optimizer
# and the lowcomm settings; a recipe (and --config's override of it) may also set the spec's
# ``weight_decay``, ``clip_grad`` and ``lr_decay``, and ``warm_start`` f: its lowcomm ``switch_step``
# and the warm-up are f x --steps (mtdao's authors warm up over their warm start; 0: none). Chosen on
# this task with 2 workers; see lab/notes/reference-task.md.
RECIPES: dict[str, dict] = {
    "adamw": {"lr": 1e-3, "lowcomm": {"method": "adamw"}},
    # the 900-step sweep of lab/notes/reference-task/2026-11-24-sweeps.csv: lr 2e-3 and Psyche's decay 0.995 reach adamw's
    # loss in 195 steps (lr 1e-3, decay 0.9: 285; adamw: 225), at the same bytes
    "demo": {"lr": 2e-3, "lowcomm": {"method": "demo", "topk": 1, "chunk": 8, "decay": 0.995, "value_dtype": "int8"}},
    "diloco": {"lr": 1e-3, "lowcomm": {"method": "diloco", "sync_every": 20}},
    "dct_diloco": {"lr": 1e-3, "lowcomm": {"method": "dct_diloco", "sync_every": 20, "topk": 32, "chunk": 16,
                                           "value_dtype": "bf16", "average": "world"}},
    # the published recipe (64x64 chunks, 2-bit values, error feedback 0.95, outer lr 1, no DCT) at
    # the diloco recipe's H, keeping 256 of 4096 (the published 64 lost 13% of loss here); inner lr
    # 2e-3 from the sweep (345 steps to adamw's loss, 420 at 1e-3)
    "sparseloco": {"lr": 2e-3, "lowcomm": {"method": "sparseloco", "sync_every": 20, "topk": 256}},
    # the authors' recipe (their 16M config, mosaic_mup_16M_qhadamw.toml): synchronous Adam (betas 0.9,
    # 0.999) warming up over the first third, then momentum zeroed, one momentum 0.999 weighted 0.98,
    # beta2 0.999, lr x4 held, parameters and both moments averaged every 32 steps; clipping 1.0
    "mtdao": {"lr": 1e-3, "clip_grad": 1.0, "lr_decay": "none", "warm_start": 1 / 3, "lowcomm": MTDAO_PUBLISHED},
    # Dion's published defaults (rank 1/4, mu 0.95); the lr of its orthonormal step (0.02) and AdamW's of
    # the rest (4e-3) from the exploration of issue 41: 190 steps to the tuned adamw's loss on seed 0
    # (lab/notes/muon-outer-loop.md; matrix_lr 0.04: 220; rank 1/32: 490)
    "dion": {"lr": 4e-3, "lowcomm": {"method": "dion", "rank_fraction": 0.25, "matrix_lr": 0.02}},
}
# Spec fields a recipe (or --config's override for a method) may set beside lr and lowcomm
RECIPE_FIELDS = ("weight_decay", "clip_grad", "lr_decay")

# The one-bit outer loop (issue 41's best compressed method, issue 55's recipe): only its outer side
# is fixed here: H, the outer optimizer (lr 1, no momentum), the codec (every pseudo-gradient element
# as one sign bit with a per-tensor scale, error feedback decayed 0.95). Its inner optimizer is the
# user's dense one at the user's own settings (:func:`sign_recipe`): an inner lr tuned on the
# 446k-parameter reference model cost 37% more steps at 128M, where dense Muon's own lr inside the
# loop reached parity (docs/results/model-size.md).
SIGN_OUTER = {"method": "dct_diloco", "sync_every": 5, "outer_lr": 1.0, "outer_momentum": 0.0, "topk": 64, "chunk": 8,
              "transform": "none", "value_dtype": "sign", "decay": 0.95, "average": "world"}
DENSE_FORMS = ("muon", "adamw")
# The long-H recipe's growth of H ([from_step, H]: H 5 to step 100, then 10, 20, and 30 from step
# 600): the long_h benchmark's pick over a 3000-step budget (docs/results/long-intervals.md)
LONG_SCHEDULE = [[100, 10], [300, 20], [600, 30]]


def sign_recipe(dense: str, muon_lr: float | None = None, muon_momentum: float = 0.95, **outer) -> dict:
    """The lowcomm section of the one-bit recipe around the dense optimizer ``dense`` ("muon": torch's
    Muon on the hidden matrices at the dense run's ``muon_lr`` and ``muon_momentum``, AdamW at the
    dense run's lr on the rest; "adamw": AdamW at the dense run's lr, the method's default inner
    optimizer), with ``outer`` over :data:`SIGN_OUTER` (``sync_every``...). The dense lr of AdamW is the
    run's own lr (the optimizer section's), not a key of the section."""
    from ..settings import ConfigError, check_choice, check_positive

    check_choice("sign_recipe", "dense", dense, DENSE_FORMS)
    unknown = sorted(set(outer) - set(SIGN_OUTER))
    if unknown:
        raise ConfigError(f"sign_recipe: {', '.join(unknown)} are not outer settings; allowed: {', '.join(SIGN_OUTER)}")
    section = {**SIGN_OUTER, **outer}
    if dense == "muon":
        check_positive("sign_recipe", "muon_lr", muon_lr)
        section.update(inner_optimizer="muon", inner_muon_lr=float(muon_lr), inner_muon_momentum=float(muon_momentum))
    elif muon_lr is not None:
        raise ConfigError("sign_recipe: muon_lr is for dense 'muon' only; the AdamW form takes the run's lr")
    return section


# -- what ``ds-lowcomm plan`` prices by name ---------------------------------------------------
# Each entry: its lowcomm section (the method included), ``optimizer``, the dense optimizer of its
# local steps where the section does not choose it (as DeepSpeed's Muon section does), and
# ``baseline``, the dense entry its measured steps ratio is against (ds_lowcomm/measured.json holds
# each ratio under the entry's name: never here).
#
# The dense baselines users train with: the gradients' all-reduce every step (DDP's; ds_lowcomm's
# adamw books the same bytes) before AdamW, or before torch's Muon on the hidden matrices and AdamW
# on the rest (compare's dense Muon).
DENSE_BASELINES: dict[str, dict] = {
    "adamw": {"lowcomm": RECIPES["adamw"]["lowcomm"], "optimizer": "adamw", "baseline": "adamw",
              "about": "dense AdamW: the gradients all-reduced, then AdamW"},
    "muon": {"lowcomm": RECIPES["adamw"]["lowcomm"], "optimizer": "muon", "baseline": "muon",
             "about": "dense Muon: the gradients all-reduced, then Muon on the hidden matrices, AdamW on the rest"},
}
# The recipes users are told to run (the README), each around its dense baseline: the one-bit outer
# loop with dense Muon inside (configs/muloco_sign*.json), the same at H 10 (fewer bytes, a few more
# steps), the long-H form (H growing from 5 to 30 over the first 600 steps: configs/muloco_sign_long*.json)
# and with AdamW (configs/adamw_sign.json). ``measured_as``: the entry under which a benchmark
# measured it (at its H), where that is another name; ``measured_in``: which benchmark ("scale",
# the default, or "long_h": budgets of thousands of steps).
RECOMMENDED: dict[str, dict] = {
    "muloco_sign": {"lowcomm": SIGN_OUTER, "optimizer": "muon", "baseline": "muon"},
    "muloco_sign_h10": {"lowcomm": {**SIGN_OUTER, "sync_every": 10}, "optimizer": "muon", "baseline": "muon",
                        "measured_as": "muloco_sign"},
    "muloco_sign_long": {"lowcomm": {**SIGN_OUTER, "sync_every_schedule": LONG_SCHEDULE}, "optimizer": "muon",
                         "baseline": "muon", "measured_as": "growing", "measured_in": "long_h"},
    "adamw_sign": {"lowcomm": SIGN_OUTER, "optimizer": "adamw", "baseline": "adamw"},
}
# Every entry priced by name: the compare recipes (their ratios are against adamw), the dense
# baselines, the recommended recipes
PLANNED: dict[str, dict] = {
    **{name: {"lowcomm": r["lowcomm"], "baseline": "adamw", **({"warm_start": r["warm_start"]} if "warm_start" in r else {})}
       for name, r in RECIPES.items()},
    **DENSE_BASELINES, **RECOMMENDED,
}
# Settings a recipe leaves to the user: a config runs the recipe whatever they are (its dense
# optimizer's own, which the recipe takes from the user's dense run; which collective carries the
# same payload). The local optimizer itself (inner_optimizer, or a DeepSpeed Muon section) must match.
USER_SETTINGS = ("inner_optimizer", "inner_muon_lr", "inner_muon_momentum", "inner_impl", "exchange", "compile")
