"""The session lifecycle (``docs/architecture.md``, "The session") and every out-of-order error."""

from __future__ import annotations

import contextvars

import pytest
import torch
from helpers import make_tiny_llama

import llmpress
from llmpress import Session, active_session
from llmpress.errors import LlmpressError, MissingStateError, SessionError
from llmpress.lifecycle.records import applied_recipe
from llmpress.modifiers import QuantizationModifier


def ready_session(recipe="W4A16") -> Session:
    session = Session(recipe)
    session.update_state(model=make_tiny_llama())
    return session.initialize()


def finalized_session() -> Session:
    session = ready_session()
    session.calibration_start()
    session.calibration_end()
    return session.finalize()


def test_every_exception_llmpress_defines_is_an_llmpress_error_that_says_what_to_do():
    """Each error class anywhere in the package derives from LlmpressError (so callers can catch
    one type), and an error reads as one sentence: what, got, expected, fix."""
    import importlib
    import inspect
    import pkgutil

    defined = []
    for info in pkgutil.walk_packages(llmpress.__path__, "llmpress."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as missing:  # native.gptq_triton needs Triton, a CUDA machine's package
            if missing.name != "triton":
                raise
            continue
        defined += [c for _, c in inspect.getmembers(module, inspect.isclass)
                    if issubclass(c, BaseException) and c.__module__ == module.__name__]
    assert len(defined) >= 10
    assert [c.__name__ for c in defined if not issubclass(c, LlmpressError)] == []
    error = MissingStateError("GPTQModifier needs 'calibration_data'", got="no calibration_data",
                              expected="token ids", fix="pass dataset=...")
    assert isinstance(error, SessionError) and (error.got, error.fix) == ("no calibration_data", "pass dataset=...")
    assert str(error) == ("GPTQModifier needs 'calibration_data' (got no calibration_data; expected token ids). "
                          "Fix: pass dataset=...")


def test_update_state_after_initialize_says_what_to_do():
    session = ready_session()
    with pytest.raises(SessionError, match="already initialized") as info:
        session.update_state(calibration_data=[1])
    assert "new llmpress.Session" in str(info.value)


def test_initialize_twice():
    with pytest.raises(SessionError, match="already initialized"):
        ready_session().initialize()


@pytest.mark.parametrize("event", ["calibration_start", "calibration_end", "batch_start", "optim_pre_step", "batch_end"])
def test_event_before_initialize(event):
    session = Session("W4A16")
    with pytest.raises(SessionError, match="before initialize"):
        getattr(session, event)()


def test_finalize_before_initialize():
    with pytest.raises(SessionError, match="before initialize"):
        Session("W4A16").finalize()


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.update_state(model=None),
        lambda s: s.initialize(),
        lambda s: s.calibration_start(),
        lambda s: s.loss_calculated(torch.tensor(1.0)),
        lambda s: s.finalize(),
    ],
)
def test_anything_after_finalize(call):
    with pytest.raises(SessionError, match="after finalize"):
        call(finalized_session())


def test_unknown_state_field_and_event():
    with pytest.raises(SessionError, match="unknown state field"):
        Session("W4A16").update_state(modle=1)
    with pytest.raises(SessionError, match="unknown event"):
        ready_session().event("epoch_start")


def test_missing_state_names_modifier_field_and_call():
    session = Session(QuantizationModifier(scheme="FP8"))  # static input scales need data
    session.update_state(model=make_tiny_llama())
    with pytest.raises(MissingStateError) as info:
        session.initialize()
    text = str(info.value)
    assert "QuantizationModifier needs 'calibration_data'" in text
    assert "session.update_state(calibration_data=...) before initialize()" in text


def test_missing_model():
    with pytest.raises(MissingStateError, match="needs 'model'"):
        Session("W4A16").initialize()


def test_state_from_several_places_and_overrides_win():
    model = make_tiny_llama()
    other = make_tiny_llama(seed=1)
    batches = [torch.randint(0, 512, (2, 16))]
    session = Session(QuantizationModifier(scheme="FP8"))
    session.update_state(model=other)
    session.update_state(calibration_data=batches)
    session.initialize(model=model)
    assert session.state.model is model
    session.calibration_start()
    with torch.no_grad():
        for batch in batches:
            model(input_ids=batch)
    session.calibration_end()
    session.finalize()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert q_proj.input_scale.numel() == 1 and float(q_proj.input_scale) > 0
    assert not hasattr(other.model.layers[0].self_attn.q_proj, "weight_scale")


def test_each_modifier_is_initialized_once_with_fresh_copies():
    recipe = llmpress.Recipe.from_any("W4A16")
    session = ready_session(recipe)
    assert all(m.initialized for m in session.modifiers)
    assert not any(m.initialized for m in recipe.modifiers)  # the recipe's own stay untouched


def test_active_session_is_context_local():
    with pytest.raises(SessionError, match="no session is active"):
        active_session()
    outer, inner = Session(), Session()
    with outer:
        assert active_session() is outer
        with inner:
            assert active_session() is inner
            # another context (a thread, a task) does not see it
            assert contextvars.Context().run(lambda: _active_or_none()) is None
        assert active_session() is outer
    assert _active_or_none() is None


def _active_or_none():
    try:
        return active_session()
    except SessionError:
        return None


def test_finalize_records_the_recipe_on_the_model():
    session = finalized_session()
    recorded = applied_recipe(session.state.model)
    assert recorded == session.recipe


def test_a_misspelt_hook_fails_when_the_class_is_defined():
    from llmpress.modifiers import Modifier

    with pytest.raises(TypeError, match="did you mean on_calibration_start"):
        class Typo(Modifier):
            def on_calibraton_start(self, state): ...

    class Fine(Modifier):
        def on_layer_calibrated(self, state, block): ...

        def on_window_start(self, state): ...

    assert Fine.events == {"layer_calibrated"}  # lifecycle hooks are not events


def test_a_window_in_epochs_needs_steps_per_epoch():
    from llmpress.modifiers import LearningRateModifier

    session = Session(LearningRateModifier(lr_func="constant", init_lr=0.1, start=1))
    session.update_state(model=make_tiny_llama(), optimizer=torch.optim.SGD(make_tiny_llama().parameters(), lr=0.1))
    with pytest.raises(MissingStateError, match="'steps_per_epoch' for its start/end window"):
        session.initialize()
