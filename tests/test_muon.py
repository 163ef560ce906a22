"""Which parameters take Muon's step (decided once for every path), and the dense Muon + AdamW
optimizer of the baselines against torch's two optimizers stepped side by side."""

import copy

import torch

from ds_lowcomm.optim.demo import muon_param_groups
from ds_lowcomm.optim.muon import MuonWithAdamW, split_muon_params, takes_muon_step
from lowcomm_task.model import GPT, GPTConfig


class UntiedHead(torch.nn.Module):
    """A model that names its (untied) output head as transformers' models do."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)

    def get_output_embeddings(self):
        return self.head


def test_decision_hidden_matrices_only():
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, seq_len=8))
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[i] for i, yes in takes_muon_step(model).items() if yes)
    assert chosen == ["blocks.0.fc.weight", "blocks.0.fc_out.weight", "blocks.0.proj.weight", "blocks.0.qkv.weight"]
    untied = UntiedHead()
    muon, other = split_muon_params(untied)
    assert [p is untied.hidden.weight for p in muon] == [True]
    assert {id(p) for p in other} == {id(untied.emb.weight), id(untied.head.weight), id(untied.hidden.bias),
                                      id(untied.norm.weight), id(untied.norm.bias)}
    untied.hidden.weight.use_muon = False  # DeepSpeed's tag wins, both ways
    untied.head.weight.use_muon = True
    muon, _ = split_muon_params(untied)
    assert [id(p) for p in muon] == [id(untied.head.weight)]
    # demo's groups follow the same decision: matrices that do not take Muon's step go by sign
    groups = muon_param_groups(untied)
    assert [g.get("update") for g in groups] == [None, "sign"]
    assert {id(p) for p in groups[1]["params"]} == {id(untied.emb.weight), id(untied.hidden.weight)}


def test_muon_with_adamw_is_torch_two_optimizers():
    torch.manual_seed(0)
    model = UntiedHead()
    twin = copy.deepcopy(model)
    muon_kw = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.01}
    adamw_kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
    opt = MuonWithAdamW(*split_muon_params(model), muon=muon_kw, adamw=adamw_kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    muon_params, other = split_muon_params(twin)
    ref = [torch.optim.Muon(muon_params, **muon_kw), torch.optim.AdamW(other, **adamw_kw)]
    ref_sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (s + 1)) for o in ref]
    x = torch.randint(0, 50, (4, 6))
    for step in range(4):
        if step == 2:  # a checkpoint round trip in the middle
            saved = copy.deepcopy(opt.state_dict())
            opt = MuonWithAdamW(*split_muon_params(model), muon=muon_kw, adamw=adamw_kw)
            opt.load_state_dict(saved)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1), last_epoch=step - 1)
        for m, opts in ((model, [opt]), (twin, ref)):
            loss = m.head(m.norm(m.hidden(m.emb(x)))).logsumexp(-1).mean()
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
        sched.step()
        for s in ref_sched:
            s.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(model.hidden.weight, UntiedHead().hidden.weight)


def test_matrix_assembly_owners():
    """One owner per matrix: the holder of its largest piece (fewest bytes moved); equal pieces
    (ZeRO 3) go to the least loaded rank; a matrix held whole moves nothing."""
    from ds_lowcomm.comm import Matrix, MatrixAssembly, MatrixPiece

    cut = Matrix(4, 4, (MatrixPiece(0, 0, 5, 0, 11), MatrixPiece(1, 5, 11, 0, 0)))  # mostly on rank 1
    even = [Matrix(4, 2, (MatrixPiece(0, 0, 4, 1, 0), MatrixPiece(1, 4, 4, 1, 0))) for _ in range(2)]
    whole = Matrix(2, 2, (MatrixPiece(0, 0, 4, 0, 0),))
    assembly = MatrixAssembly([whole], None, 0, 2)
    assert assembly.owners == [0] and not assembly.exchanges  # nothing cut: no collective, no transport needed
    from ds_lowcomm.comm.assemble import _owners

    # cut: rank 1 holds 11 of 16; the even ones: rank 0, less loaded than rank 1 after the cut one
    assert _owners([cut, *even, whole], 2) == [1, 0, 0, 0]


def test_plan_muon_memory_by_hand():
    from ds_lowcomm.plan import muon_memory

    m = muon_memory([(10, 4), (4, 4), (4,), (10, 4)], {0, 3}, gpus=2, zero_stage=2)
    # DeepSpeed's Muon: a momentum per Muon element (16), Adam's two moments per other (84), over 2 GPUs
    assert m["deepspeed_muon_state_bytes_per_gpu"] == (4 * 16 + 8 * 84) / 2
    assert m["demo_muon_state_bytes_per_gpu"] == 4 * 100 / 2 and m["added_state_bytes_per_gpu"] == (400 - 736) / 2
