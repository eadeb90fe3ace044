"""The tensor-parallel MLP computes exactly what the unsharded MLP does, forward and backward."""

import os

import pytest
import torch

from .conftest import finish_gloo, init_gloo, spawn


def _tp_worker(rank, world, port, tp, out_dir):
    import mlp_tp

    init_gloo(rank, world, port)
    mesh = mlp_tp.make_mesh(world, tp, "cpu")
    torch.manual_seed(0)
    full = mlp_tp.MLP(16, 64, 2)
    torch.manual_seed(0)
    sharded = mlp_tp.shard(mlp_tp.MLP(16, 64, 2), mesh)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y_full, y_tp = full(x), sharded(x)
    y_full.square().sum().backward()
    y_tp.square().sum().backward()
    errs = {"forward": (y_full - y_tp).abs().max().item()}
    full_params = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errs[name] = (g - full_params[name].grad).abs().max().item()
    local = [p.to_local().shape for p in sharded.parameters() if hasattr(p, "to_local")]
    torch.save({"errs": errs, "shapes": local, "dp": mesh["dp"].size()}, os.path.join(out_dir, f"r{rank}.pt"))
    finish_gloo()


@pytest.mark.parametrize("world,tp", [(4, 2), (2, 2)])
def test_tp_forward_and_backward_equal_unsharded(tmp_path, world, tp):
    spawn(_tp_worker, world, tp, str(tmp_path))
    for r in range(world):
        res = torch.load(tmp_path / f"r{r}.pt")
        assert res["dp"] == world // tp
        assert max(res["errs"].values()) < 1e-5, res["errs"]
        # Really sharded: the first up-projection holds 64 / tp output rows on each rank.
        assert res["shapes"][0] == torch.Size([64 // tp, 16])


def test_world_not_divisible_by_tp_is_a_clear_error():
    import mlp_tp

    with pytest.raises(
        SystemExit, match="world size 3 is not divisible by --tp 2; choose a tp that divides 3"
    ):
        mlp_tp.make_mesh(3, 2, "cpu")
