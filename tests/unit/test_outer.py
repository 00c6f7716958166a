"""The DiLoCo outer step (Nesterov SGD on pseudo-gradients)."""
from __future__ import annotations

import torch

from swarmloco.peer.config import RuntimeConfig, TrainConfig
from swarmloco.peer.model import GPT, GPTConfig
from swarmloco.peer.outer import outer_step
from swarmloco.peer.outer_config import OuterConfig
from swarmloco.peer.replica import Replica
from swarmloco.peer.task import Task, lm_loss


def test_zero_delta_leaves_params_unchanged() -> None:
    params = {"w": torch.randn(4, 3)}
    before = params["w"].clone()
    momentum = {"w": torch.zeros(4, 3)}
    for _ in range(3):
        outer_step(params, {"w": torch.zeros(4, 3)}, momentum, OuterConfig())
    assert torch.equal(params["w"], before)


def test_two_steps_hand_computed() -> None:
    cfg = OuterConfig(lr=0.5, momentum=0.9)
    params, momentum = {"w": torch.tensor([1.0])}, {"w": torch.tensor([0.0])}
    outer_step(params, {"w": torch.tensor([0.2])}, momentum, cfg)
    # m1 = 0.2; update = 0.2 + 0.9*0.2 = 0.38; θ1 = 1 - 0.5*0.38 = 0.81
    assert torch.allclose(momentum["w"], torch.tensor([0.2]))
    assert torch.allclose(params["w"], torch.tensor([0.81]))
    outer_step(params, {"w": torch.tensor([-0.1])}, momentum, cfg)
    # m2 = 0.9*0.2 - 0.1 = 0.08; update = -0.1 + 0.9*0.08 = -0.028; θ2 = 0.81 + 0.014 = 0.824
    assert torch.allclose(momentum["w"], torch.tensor([0.08]))
    assert torch.allclose(params["w"], torch.tensor([0.824]))


def test_matches_torch_sgd_nesterov() -> None:
    torch.manual_seed(0)
    theta = torch.randn(10)
    p = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    params, momentum = {"w": theta.clone()}, {"w": torch.zeros(10)}
    for _ in range(5):
        delta = torch.randn(10)
        p.grad = delta.clone()
        sgd.step()
        outer_step(params, {"w": delta}, momentum, OuterConfig(lr=0.7, momentum=0.9))
    assert torch.allclose(params["w"], p.detach(), atol=1e-6)


def _tiny_task() -> Task:
    cfg = GPTConfig(context=16, d_model=16, n_layers=1, n_heads=2)
    data = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1))

    def batches(start: int):
        step = start
        while True:
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 4000, (4,), generator=g)[:, None] + torch.arange(17)
            yield data[idx][:, :-1], data[idx][:, 1:]
            step += 1

    def factory() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)

    return Task(
        name="t",
        model_factory=factory,
        train_batches=batches,
        loss_fn=lm_loss,
        evaluate=lambda m: 0.0,
        config=cfg.to_dict(),
    )


def test_h1_lr1_momentum0_equals_plain_training() -> None:
    task = _tiny_task()
    train = TrainConfig(inner_steps=1, warmup_steps=0, grad_clip=0)
    replica = Replica(task, train, OuterConfig(lr=1.0, momentum=0.0), RuntimeConfig(device="cpu"))
    plain = task.model_factory()
    opt = torch.optim.AdamW(
        plain.parameters(), lr=train.lr, betas=(train.beta1, train.beta2), weight_decay=train.weight_decay
    )
    stream = task.train_batches(0)
    for _ in range(5):
        replica.inner_step()
        replica.apply_outer(replica.pseudo_gradient())
        loss = lm_loss(plain, next(stream))
        opt.zero_grad()
        loss.backward()
        opt.step()
    for name, p in plain.named_parameters():
        # θ − (θ − x) is x up to one rounding of θ's magnitude.
        assert torch.allclose(replica.global_params[name], p.detach(), atol=1e-6, rtol=0), name
