"""`dynstate inspect` on a checkpoint written by the resume harness names the right store,
version and position, and shows exactly the batch the resumed run sees next."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dynstate import StateMismatchError, Store, find_sampler_state
from dynstate.cli import cli
from dynstate.loading.checkpoint import describe_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
import resume_harness as h


@pytest.mark.parametrize("mode", ["epoch", "mix"])
def test_inspect_names_version_position_and_next_batch(tmp_path, mode):
    cfg = h.Config(url=str(tmp_path / "store"), steps=7, batch_size=3, mode=mode, ckpt_every=3)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    h.train(cfg, ckpt_dir=str(ckpt), stop_after=3)
    state = find_sampler_state(torch.load(ckpt / "latest.pt", weights_only=True))
    resumed = h.train(dataclasses.replace(cfg, steps=5), ckpt_dir=str(ckpt), resume=True)

    result = CliRunner().invoke(cli, ["inspect", str(ckpt / "latest.pt"), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["store_id"] == Store.open(cfg.url).store_id
    assert (info["version"], info["position"], info["epoch"]) == (
        state["version"],
        state["position"],
        state["epoch"],
    )
    assert [row["id"] for row in info["next_rows"]] == resumed[4]

    table = CliRunner().invoke(cli, ["inspect", str(ckpt)])
    assert table.exit_code == 0 and f"pinned version {state['version']}," in table.output


def test_inspect_refuses_a_file_without_sampler_state(tmp_path):
    torch.save({"step": 3}, tmp_path / "data.pt")
    with pytest.raises(StateMismatchError, match="no dynstate sampler state"):
        describe_checkpoint(str(tmp_path))
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path / "data.pt")])
    assert result.exit_code == 1 and "error:" in result.output


class _CountingServer:
    """An HTTP server on loopback that answers 404 to everything and counts the requests."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                self.send_error(404)

            do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/store"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _checkpoint_naming(tmp_path: Path, store_url: str) -> tuple[Path, dict]:
    """A real loader checkpoint of a local store, whose sampler state then records
    ``store_url``, as a data.pt from elsewhere may."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from dynstate import VersionedDataset, VersionedSampler

    store = Store.open(str(tmp_path / "store"), create=True)
    store.append([{"id": i} for i in range(10)], meta={"step": 0})
    dataset = VersionedDataset(store.url)
    sampler = VersionedSampler(dataset, seed=1, batch_size=2)
    loader = StatefulDataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=list)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    find_sampler_state(state)["store_url"] = store_url
    folder = tmp_path / "ckpt" / "global_step_7"
    folder.mkdir(parents=True)
    torch.save(state, folder / "data.pt")
    return folder, find_sampler_state(state)


def _installed(*args: str) -> tuple[int, str, str]:
    import os
    import subprocess

    dynstate = os.path.join(os.path.dirname(sys.executable), "dynstate")
    proc = subprocess.run([dynstate, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "100"})  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def test_inspect_names_a_remote_store_and_opens_it_only_when_asked(tmp_path):
    """An untrusted data.pt may name any server or bucket: without --open-store, inspect says
    which store it names and what the checkpoint holds, and sends nothing anywhere."""
    server = _CountingServer()
    try:
        folder, state = _checkpoint_naming(tmp_path, server.url)
        code, out, err = _installed("inspect", str(folder))
        assert (code, err) == (0, ""), err
        assert server.requests == []
        lines = out.splitlines()
        assert lines[0] == f"checkpoint:       {folder / 'data.pt'}"
        assert lines[1:6] == [
            "training step:    7 (folder global_step_7)",
            f"store:            {server.url} (id {state['store_id']}), recorded; not opened",
            f"sampler:          mode epoch, seed 1, pinned version {state['version']}, "
            f"base rows {state['base_rows']:,}",
            f"sampler counters: epoch 0, position {state['position']:,}, "
            f"batches handed out {state['step']:,}",
            "selection:        none (every row drawn uniformly)",
        ]
        assert lines[6] == (
            f"note: {server.url} is not on this machine, so it was not opened: a checkpoint from "
            "elsewhere may name any server or bucket, which opening would read with your "
            "credentials; pass --open-store to open it, or --store URL to name the store yourself"
        )
        code, out, _ = _installed("inspect", str(folder), "--json")
        info = json.loads(out)
        assert code == 0 and server.requests == []
        assert (info["opened"], info["store_url"], info["training_step"]) == (False, server.url, 7)
        assert "head" not in info and "next_rows" not in info
        # Asked to: it is opened (and, being no store, fails in one line).
        code, out, err = _installed("inspect", str(folder), "--open-store")
        assert code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1
        assert server.requests != []
    finally:
        server.close()


@pytest.mark.parametrize(
    "recorded",
    ["s3://some-bucket/run", "gs://b/run", "simplecache::s3://b/run", "https://h.example/run"],
)
def test_inspect_does_not_open_any_non_local_url_by_default(tmp_path, recorded):
    folder, _ = _checkpoint_naming(tmp_path, recorded)
    info = describe_checkpoint(str(folder))
    assert info["opened"] is False and info["store_url"] == recorded
    assert info["not_opened"].startswith(f"{recorded} is not on this machine")


def test_inspect_of_a_recorded_url_with_credentials_never_prints_them(tmp_path):
    secret = "Zq9/Xw7+Secret/Value"
    folder, _ = _checkpoint_naming(tmp_path, f"s3://AKID:{secret}@bucket/run")
    code, out, err = _installed("inspect", str(folder))
    assert code == 0 and "s3://***@bucket/run" in out
    assert secret not in out + err and "Zq9" not in out + err


def test_inspect_opens_a_local_recorded_store_and_a_store_named_by_the_user(tmp_path):
    folder, state = _checkpoint_naming(tmp_path, str(tmp_path / "store"))
    info = describe_checkpoint(str(folder))
    assert info["opened"] is True and info["head"] == 1 and info["next_rows"]
    remote, _ = _checkpoint_naming(tmp_path / "other", "s3://nowhere/run")
    named = describe_checkpoint(str(remote), store_url=str(tmp_path / "other" / "store"))
    assert named["opened"] is True and named["store_id"] != state["store_id"]
