"""The speed settings of issue 13 change how the step runs, never what it computes: each trains to the
default path's losses on CPU (tiny shapes); the CUDA-only parts are checked on a GPU (marked)."""
import pytest
import torch

from dflash.config import ConfigError


def _losses(run_dir) -> list[float]:
    from dflash.tracking.loggers import read_jsonl_metrics
    return [r["train/loss"] for r in read_jsonl_metrics(run_dir) if "train/loss" in r]


def _train(fast_cfg, *overrides, run, mode="inline"):
    """Losses of a short run; inline producer by default: the buffer fills in the same order every run (a
    producer thread races the consumer)."""
    from dflash.app.run import train
    return _losses(train(fast_cfg("trainer.max_steps=4", "trainer.checkpoint_every=100", f"trainer.producer_mode={mode}",
                                  *overrides, run=run)).run_dir)


def test_every_compile_mode_trains_to_the_eager_losses(fast_cfg, monkeypatch):
    """trainer.compile_mode reaches torch.compile (aot_eager stands in for inductor: minutes of CPU codegen),
    and the compiled drafter, CUDA-graph step marking included, trains to the eager run's losses."""
    from dflash.training.compiling import COMPILE_MODES
    real, seen, marks = torch.compile, [], []

    def recording_compile(model, **kwargs):
        seen.append(kwargs)
        return real(model, backend="aot_eager")
    eager = _train(fast_cfg, "trainer.pad_multiple=32", "trainer.compile=false", run="eager")
    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for mode, (kwargs, graphs) in COMPILE_MODES.items():
        seen.clear(), marks.clear()
        got = _train(fast_cfg, "trainer.pad_multiple=32", "trainer.compile=true", f"trainer.compile_mode={mode}",
                     run=mode)
        assert seen == [kwargs], mode
        assert len(marks) == (4 if graphs else 0), mode  # CUDA-graph modes mark every step
        assert got == pytest.approx(eager, rel=1e-5), mode


def test_stream_and_chunk_settings_train_to_the_default_losses(fast_cfg):
    """producer_stream=side (on CPU there are no streams: the plumbing; the GPU test below checks the sync),
    a different LM-head chunk and the target's fused pieces (uncompiled: transformers' math exactly; compiled by
    inductor's CPU backend) give the default run's losses."""
    default = _train(fast_cfg, run="default")
    settings = ("trainer.producer_stream=side", "loss.chunk_size=5", "target.fused_ops=eager", "target.fused_ops=compile")
    for i, setting in enumerate(settings):
        rel = 1e-4 if setting.endswith("compile") else 1e-5
        assert _train(fast_cfg, setting, run=f"variant{i}") == pytest.approx(default, rel=rel), setting
    torch._dynamo.reset()


def test_unknown_speed_settings_are_rejected_before_any_work(fast_cfg):
    from dflash.config import validate
    for bad, key in (("trainer.compile_mode=fastest", "trainer.compile_mode"),
                     ("trainer.producer_stream=other", "trainer.producer_stream"),
                     ("loss.lm_head_kernel=fastest", "loss.lm_head_kernel"), ("target.fused_ops=fastest", "target.fused_ops")):
        with pytest.raises(ConfigError, match=key):
            validate(fast_cfg(bad))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_side_stream_producer_trains_to_the_same_losses_on_gpu(fast_cfg, mode):
    """On a GPU the target runs on its own stream beside the drafter's queued work: with the consumer's
    stream waiting on it and the items recorded on the consumer's stream, every step sees the same
    features, so the losses equal the one-stream run's (bf16 autocast, no NaN). The deterministic buffer
    makes the thread producer's pull order independent of timing."""
    # FAST's tiny target with head sizes the fast Gated-DeltaNet kernels take (later keys win over FAST's)
    common = ("target.random.hidden_size=256", "target.random.head_dim=64", "target.random.linear_head_dim=64",
              "target.random.intermediate_size=512", "+buffer=deterministic", "buffer.timeout_s=60")
    default = _train(fast_cfg, *common, run="one_stream", mode=mode)
    side = _train(fast_cfg, *common, "trainer.producer_stream=side", run="side", mode=mode)
    assert all(torch.isfinite(torch.tensor(side)))
    assert side == pytest.approx(default, rel=1e-4)


@pytest.mark.gpu
def test_triton_lm_head_and_compiled_target_train_to_the_torch_losses_on_gpu(fast_cfg):
    """On a GPU the defaults (`loss.lm_head_kernel=auto` → triton, `target.fused_ops=auto` → compile) train to the
    losses of the torch chunk on transformers' own modules, within bf16's rounding."""
    common = ("target.random.hidden_size=256", "target.random.head_dim=64", "target.random.linear_head_dim=64",
              "target.random.intermediate_size=512")
    before = _train(fast_cfg, *common, "loss.lm_head_kernel=torch", "target.fused_ops=off", run="torch")
    after = _train(fast_cfg, *common, run="defaults")
    assert all(torch.isfinite(torch.tensor(after)))
    assert after == pytest.approx(before, rel=2e-2)
    torch._dynamo.reset()


def test_compile_caches_persist_under_the_users_cache_folder_keyed_by_versions(tmp_path):
    import torch

    from dflash.devices import persist_compile_caches
    env = {"DFLASH_CACHE": str(tmp_path / "c"), "TRITON_CACHE_DIR": "/mine"}
    set_now = persist_compile_caches(env)
    assert env["TRITON_CACHE_DIR"] == "/mine" and "TRITON_CACHE_DIR" not in set_now  # the user's own setting wins
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor" / f"torch-{torch.__version__}")
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert persist_compile_caches({"DFLASH_COMPILE_CACHE": "0"}) == {}
