"""One execution config: the kernel choice is parsed once at the front doors, carried by the model
(``model.execution``) and handed to the drafter by ``bind``."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jspec
from jspec.drafters import MTP, DraftModel, Eagle3, NGram, init_mtp_head
from jspec.execution import Execution, Kernels, with_kernels
from tests.tiny import eagle3_head, tiny_model


def test_the_impl_string_parses_into_kernels_and_back():
    kernels = Kernels.parse("auto,skinny_matmul=xla,decode_attention=pallas")
    assert kernels.default == "auto"
    assert kernels.mode("skinny_matmul") == "xla" and kernels.mode("decode_attention") == "pallas"
    assert kernels.mode("gather_rows") == "auto"
    assert str(kernels) == "auto,decode_attention=pallas,skinny_matmul=xla"  # overrides in kernel order
    assert Kernels.parse(str(kernels)) == kernels and hash(Kernels.parse(str(kernels))) == hash(kernels)
    assert Kernels.parse(kernels) is kernels


@pytest.mark.parametrize("impl", ["fast", "auto,foo=xla", "auto,skinny_matmul", "auto,skinny_matmul=fast",
                                  "auto,skinny_matmul=xla,skinny_matmul=auto", 3])
def test_a_bad_impl_is_a_value_error_naming_it(impl):
    with pytest.raises(ValueError, match="impl"):
        Kernels.parse(impl)


def test_a_bad_impl_is_refused_at_the_front_doors_before_anything_compiles(monkeypatch):
    from jspec import engine, speculative

    model = tiny_model()
    ran = []
    for module, name in ((engine, "generate_on_device"), (engine, "_score_on_device"),
                         (speculative, "speculative_on_device")):  # the jitted programs behind the doors
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: ran.append(name))
    for call in (lambda: jspec.generate(model, [[1, 2, 3]], 4, impl="auto,skinny_matmul=fast"),
                 lambda: jspec.score(model, [[1, 2, 3]], impl="fastest"),
                 lambda: jspec.speculative_generate(model, NGram(), [[1, 2, 3]], 4, impl="xla,gather_rows")):
        with pytest.raises(ValueError, match="impl"):
            call()
    assert not ran
    jspec.score(model, [[1, 2, 3]], impl="xla")  # with a good impl the door does reach its program
    assert ran == ["_score_on_device"]


def test_the_model_carries_its_kernels_and_with_kernels_changes_only_them():
    model = tiny_model()
    assert model.execution == Execution()
    invariant = with_kernels(model, "invariant")
    assert invariant.execution.kernels == Kernels("invariant") and invariant.execution.placement is None
    assert with_kernels(model, None) is model
    assert jax.tree.leaves(invariant) == jax.tree.leaves(model)  # the same arrays: the choice is static


@pytest.mark.parametrize("make", [
    lambda target: DraftModel(tiny_model(1)),
    lambda target: DraftModel(target),
    lambda target: Eagle3(eagle3_head(3, target, aux=(0, 1, 1))),
    lambda target: MTP(init_mtp_head(target.config, jax.random.key(4), scale=0.3)),
], ids=["draft-model", "self", "eagle3", "mtp"])
def test_bind_hands_the_targets_kernels_to_the_drafter(make):
    target = with_kernels(tiny_model(), "invariant,skinny_matmul=xla")
    bound = make(target).bind(target)
    execution = bound.model.execution if isinstance(bound, DraftModel) else bound.execution
    assert execution.kernels == target.execution.kernels


def test_one_impl_makes_target_and_drafter_invariant(monkeypatch):
    """``speculative_generate(t, DraftModel(t), ..., impl="invariant")``: the drafter the round runs is
    bound to the invariant target, so it drafts on the invariant kernels too (no second ``impl``)."""
    target = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_model())
    seen = []
    bind = DraftModel.bind
    monkeypatch.setattr(DraftModel, "bind", lambda self, t: seen.append(bind(self, t)) or seen[-1])
    # tests/test_invariant.py's shapes (prompts, new tokens, k): the same programs, so a run that
    # compiled them there takes them from the persistent compilation cache here.
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]]
    result = jspec.speculative_generate(target, DraftModel(target), prompts, 24, num_draft_tokens=3,
                                        impl="invariant")
    assert [d.model.execution.kernels for d in seen] == [Kernels("invariant")]
    assert result.tokens == jspec.generate(target, prompts, 24, impl="invariant")
    # Self-drafting on the same kernels as the target: every draft is the target's own token.
    assert (result.stats["accepted"] >= 3 * (result.stats["rounds"] - 1)).all()


def test_a_drafter_is_a_pytree_whose_kernels_are_static():
    target = with_kernels(tiny_model(), "xla")
    drafter = Eagle3(eagle3_head(3, target, aux=(0, 1, 1))).bind(target)
    leaves, tree = jax.tree.flatten(drafter)
    assert jax.tree.unflatten(tree, leaves).execution == drafter.execution
    assert dataclasses.replace(drafter, execution=Execution()) != drafter
