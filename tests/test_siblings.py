"""Siblings look alike: a concept two method files share has the same shape and names in each,
though each file keeps its own copy (the FIFO of embeddings, the momentum encoder and its EMA,
the recipe function and train_step's arguments)."""
import importlib
import inspect
import re

import pytest
import torch

import common
import moco_simmoco_simco as mss
import nnclr_dcl
import simsiam_byol_gsg as gsg
from helpers import METHODS, ctx_for

METHOD_FILES = tuple(importlib.import_module(name) for name in METHODS)
MARKER = re.compile(r"^ *# (shared|own): ", re.M)


def test_key_queue_and_support_set_are_one_fifo_shape():
    """MoCo's KeyQueue and NNCLR's SupportSet: (size, dim, seed=0); buffers `rows` (size, dim),
    random unit vectors from the seed alone, and the write position `ptr`; push(rows, ...) writes
    at ptr and refuses more rows than the FIFO holds, in a ValueError naming the class."""
    for fifo in (mss.KeyQueue, nnclr_dcl.SupportSet):
        signature = inspect.signature(fifo)
        assert list(signature.parameters) == ["size", "dim", "seed"], fifo
        assert signature.parameters["seed"].default == 0, fifo
        assert list(inspect.signature(fifo.push).parameters)[:2] == ["self", "rows"], fifo
    torch.manual_seed(0)
    queue = mss.KeyQueue(6, 3, seed=4)
    torch.manual_seed(1)  # the global RNG plays no part
    again, support = mss.KeyQueue(6, 3, seed=4), nnclr_dcl.SupportSet(6, 3, seed=4)
    assert torch.equal(queue.rows, again.rows) and torch.equal(queue.rows, support.rows)
    assert not torch.equal(queue.rows, mss.KeyQueue(6, 3, seed=5).rows)
    assert queue.rows.shape == (6, 3)
    assert torch.allclose(queue.rows.norm(dim=1), torch.ones(6))
    assert set(dict(queue.named_buffers())) == {"rows", "ptr"}
    assert set(dict(support.named_buffers())) == {"rows", "labels", "ptr"}
    queue.push(torch.ones(4, 3))
    support.push(torch.ones(4, 3), torch.arange(4))
    assert queue.ptr.item() == support.ptr.item() == 4
    with pytest.raises(ValueError, match="KeyQueue of 6 rows cannot take a batch of 7"):
        queue.push(torch.ones(7, 3))
    with pytest.raises(ValueError, match="SupportSet of 6 rows cannot take a batch of 7"):
        support.push(torch.ones(7, 3), torch.arange(7))


def test_momentum_encoder_and_ema_update_are_the_same_code_in_both_files():
    """MoCo's key encoder and BYOL's target come from momentum_encoder(model, ctx), a frozen copy
    of the model; ema_update(target, online, momentum) moves it: the same source in both files."""
    for name in ("momentum_encoder", "ema_update"):
        assert inspect.getsource(getattr(mss, name)) == inspect.getsource(getattr(gsg, name)), name
    ctx = ctx_for()
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    frozen = gsg.momentum_encoder(model, ctx)
    for p, f in zip(model.parameters(), frozen.parameters()):
        assert torch.equal(p, f) and p is not f and not f.requires_grad and p.requires_grad


@pytest.mark.rule("recipes-and-step")
@pytest.mark.parametrize("module", METHOD_FILES, ids=METHODS)
def test_every_method_file_has_recipes_and_the_same_first_train_step_arguments(module):
    """recipes(args) -> one common.Recipe per view (no file keeps a `recipe`); train_step(net,
    optimizer, views, args, ctx, ...), the file's own state after."""
    args = module.parse_args(["--stopgrad", "symmetric"] if module is gsg else [])
    args.image_size = 32
    views = module.recipes(args)
    assert len(views) == 2 and all(isinstance(r, common.Recipe) for r in views), module
    assert not hasattr(module, "recipe"), module
    first = list(inspect.signature(module.train_step).parameters)[:5]
    assert first == ["net", "optimizer", "views", "args", "ctx"], module


def blocks(module):
    """main()'s marked blocks: [(kind, text)], each from its marker line to the next marker (or
    main's end), blank lines dropped."""
    source = inspect.getsource(module.main)
    starts = [m.start() for m in MARKER.finditer(source)]
    pieces = []
    for start, end in zip(starts, starts[1:] + [len(source)]):
        text = source[start:end]
        lines = [line for line in text.splitlines() if line.strip()]
        kind = MARKER.match(text).group(1)
        pieces.append((kind, "\n".join(lines)))
    return source, starts, pieces


@pytest.mark.rule("shared-and-own")
@pytest.mark.parametrize("module", METHOD_FILES, ids=METHODS)
def test_every_main_marks_its_shared_and_own_lines(module):
    """Each main() is marked in blocks from its second line on: `# shared: ...` the lines every
    method file repeats, word for word, in the same order; `# own: ...` the method's own."""
    source, starts, pieces = blocks(module)
    body = source.splitlines()[1:]
    first = next(line for line in body if line.strip())
    assert MARKER.match(first), (module.__name__, first)
    assert any(kind == "own" for kind, _ in pieces), module
    texts = [text for kind, text in pieces if kind == "shared"]
    reference = [text for kind, text in blocks(METHOD_FILES[0])[2] if kind == "shared"]
    assert len(reference) >= 3
    assert texts == reference, module.__name__
