"""A resumed DDP run ends bit for bit where an uninterrupted one ends (gpt.py --exact), and why the
flag is needed: without it DDP rebuilds its gradient buckets after the first step of every start,
so the step after a resume all-reduces with another layout (another float summation order)."""

import copy
import os

import torch

from .conftest import finish_gloo, init_gloo, spawn

CFG = dict(vocab_size=17, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS, RESUME_AT, WORLD = 6, 3, 4


def _train(model, opt, batches, exact):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, find_unused_parameters=exact)  # what gpt.py does with --exact
    for x, y in batches:
        _, loss = ddp(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _worker(rank, world, port, out_dir):
    import gpt_model

    init_gloo(rank, world, port)
    g = torch.Generator().manual_seed(3)
    data = [
        torch.randint(0, CFG["vocab_size"], (8 * world, CFG["block_size"] + 1), generator=g)
        for _ in range(STEPS)
    ]
    batches = [(d[:, :-1].chunk(world)[rank], d[:, 1:].chunk(world)[rank]) for d in data]
    got = {}
    for exact in (False, True):
        for resumed in (False, True):
            torch.manual_seed(0)
            model = gpt_model.GPT(gpt_model.ModelConfig(**CFG))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            if not resumed:
                _train(model, opt, batches, exact)
            else:
                _train(model, opt, batches[:RESUME_AT], exact)
                state = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
                # A new worker: a new model, optimizer and DDP.
                model = gpt_model.GPT(gpt_model.ModelConfig(**CFG))
                model.load_state_dict(state["model"])
                opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
                opt.load_state_dict(state["optimizer"])
                _train(model, opt, batches[RESUME_AT:], exact)
            got[(exact, resumed)] = model.state_dict()
    if rank == 0:
        torch.save(got, os.path.join(out_dir, "models.pt"))
    finish_gloo()


def test_exact_mode_resumes_bit_for_bit_and_default_ddp_does_not(tmp_path):
    spawn(_worker, WORLD, str(tmp_path))
    got = torch.load(tmp_path / "models.pt")

    def differing(a, b):
        return [k for k in a if not torch.equal(a[k], b[k])]

    assert differing(got[(True, False)], got[(True, True)]) == []
    # The default: the resumed run's first step summed the gradients in another order.
    assert differing(got[(False, False)], got[(False, True)]) != []
