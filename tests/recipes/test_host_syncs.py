"""The PPO update loop copies values from the device to the host only where it must.

Every ``.item()``, ``.tolist()``, ``float(t)``, ``int(t)`` and ``bool(t)`` of a tensor waits for the
device (a CUDA sync). Inside ``_ppo_updates`` the recipe needs exactly one per optimizer step and
model (the non-finite guard decides whether to step), one more per actor step with
``ppo.max_update_kl`` (whether to undo it), and one at the end (the step's statistics, copied
together). The micro-batches and their packed layouts are planned before it
(``_update_plan``) from the batch's host copy, so they read nothing from the device. This test counts them, in the trainer's thread, by patching those methods.
Calls made by torch itself are not counted: the optimizers read their step counters with
``.item()``, but those live on the host (``capturable=False``), so reading them never waits for
the device.
"""

import runpy
import sys
import threading
from pathlib import Path

import torch

from minippo.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__")
TORCH_DIR = str(Path(torch.__file__).parent)


def _run_counting(overrides: list[str]) -> tuple[list[int], int]:
    """Run the tiny recipe in this process; return the conversions counted in each
    ``_ppo_updates`` call and the optimizer steps each call takes."""
    recipe_globals = runpy.run_path(str(REPO / "recipes" / "async_ppo.py"))
    recipe_cls = recipe_globals["AsyncPPORecipe"]
    trainer = threading.get_ident()
    counts: list[int] = []
    active = [False]

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if active[0] and threading.get_ident() == trainer and TORCH_DIR not in caller:
                counts[-1] += 1
            return real(self, *args, **kwargs)

        return real, wrapper

    patches = {name: counting(name) for name in CONVERSIONS}
    real_updates = recipe_cls._ppo_updates

    def updates(self, *args, **kwargs):
        counts.append(0)
        active[0] = True
        try:
            return real_updates(self, *args, **kwargs)
        finally:
            active[0] = False

    cfg = load_config("tiny_cpu", overrides)
    try:
        for name, (_, wrapper) in patches.items():
            setattr(torch.Tensor, name, wrapper)
        recipe_cls._ppo_updates = updates
        recipe_globals["recipe_main"](cfg)
    finally:
        for name, (real, _) in patches.items():
            setattr(torch.Tensor, name, real)
        recipe_cls._ppo_updates = real_updates
    return counts, cfg.ppo.epochs * cfg.ppo.minibatches


def test_one_host_sync_per_optimizer_step_and_model(tmp_path):
    base = [
        f"output_dir={tmp_path}",
        "total_steps=2",
        "rollout.groups_per_batch=8",
        "rollout.samples_per_prompt=4",
        "ppo.minibatches=2",
        "ppo.micro_batch_size=4",  # 2 micro-batches per minibatch
        "engine.in_process=true",
        "progress_bar=false",
        "checkpoint.export_hf=false",
    ]
    # actor + critic (GAE, EWMA correction), no update bound: 2 finite checks per optimizer step
    # + 1 at the end
    gae = [*base, f"output_dir={tmp_path / 'gae'}", "ppo.max_update_kl=null"]
    counts, opt_steps = _run_counting(gae)
    assert counts == [2 * opt_steps + 1] * 2, counts
    # critic-free GRPO with KL in the loss and a TIS correction, tiny_cpu's update bound: 1 finite
    # check and the bound's KL per optimizer step + 1
    counts, opt_steps = _run_counting(
        [
            *base,
            f"output_dir={tmp_path / 'grpo'}",
            "advantage_estimator=grpo",
            "kl.coef=0.1",
            "kl.mode=loss",
            "kl.estimator=k3",
            "correction._component_=minippo.rl.correction.TIS",
            "~correction.cap",
            "~correction.reset_below",
        ]
    )
    assert counts == [2 * opt_steps + 1] * 2, counts
