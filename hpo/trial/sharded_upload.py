"""A sharded run's (strategy fsdp) resume state in the artifact store: the state file and the
`sharded-state.<step>` folder it names, every rank's share, published as one artifact and put
back in place on a retry on another host.

torch.distributed.checkpoint names its files `__0_0.distcp` and `.metadata`, names the store
refuses (a store's names begin with a letter or digit): each is stored with SHARE_PREFIX before
it, which a fetch takes off again.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from hpo.storage.artifacts import ArtifactStoreError
from hpo.trainer.files import (
    SHARDED_NAME,
    SHARDED_STATE_DIR,
    STATE_FILE,
    UPLOAD_STAGE,
    drop_sharded_states,
    drop_stages,
)

SHARE_PREFIX = "dcp"


def staged_state(state_path: Path) -> Path:
    """What to publish for the state at `state_path`: the file itself, or, for a sharded run,
    a folder of hard links to it and to every file of the sharded folder it names. The links
    are a snapshot: the run may write its next checkpoint and remove this one meanwhile.
    OSError when the folder is already gone (a newer state superseded it)."""
    directory = state_path.parent
    drop_stages(directory)  # one a killed upload left holds a checkpoint's disk
    if not any(directory.glob(f"{SHARDED_STATE_DIR}.*")):
        return state_path
    stage = directory / f"{UPLOAD_STAGE}-{uuid.uuid4().hex[:8]}"
    try:
        stage.mkdir()
        _link(state_path, stage / STATE_FILE)
        name = sharded_name(stage / STATE_FILE)
        if name is not None:
            (stage / name).mkdir()
            for share in sorted((directory / name).iterdir()):
                _link(share, stage / name / f"{SHARE_PREFIX}{share.name}")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage


def sharded_name(state_file: Path) -> str | None:
    """The sharded folder a state names (None: the state of an unsharded run). OSError when
    it cannot be read, or names a folder hpo does not write."""
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError) as e:
        raise OSError(f"{state_file} unreadable: {e}") from e
    name = state.get("sharded") if isinstance(state, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or not SHARDED_NAME.fullmatch(name):
        raise OSError(f"{state_file} names {str(name)[:80]!r}, not a sharded folder hpo writes")
    return name


def adopt_sharded_state(fetched: Path, directory: Path) -> None:
    """Move the sharded folder of a state fetched into `fetched` into the trial's `directory`,
    its files under DCP's names again; before the state itself, so that no state there names a
    folder that is not. ArtifactStoreError for a folder or file hpo does not publish."""
    for folder in fetched.iterdir():
        if not folder.is_dir():
            continue
        if not SHARDED_NAME.fullmatch(folder.name):
            raise ArtifactStoreError(f"the stored state holds {folder.name[:80]!r}: refused")
        for share in list(folder.iterdir()):
            if not share.name.startswith(SHARE_PREFIX) or not share.is_file():
                raise ArtifactStoreError(f"the stored state holds {share.name[:80]!r}: refused")
            share.rename(folder / share.name[len(SHARE_PREFIX) :])
        shutil.rmtree(directory / folder.name, ignore_errors=True)
        folder.rename(directory / folder.name)
        drop_sharded_states(directory, keep=folder.name)


def _link(source: Path, target: Path) -> None:
    """A hard link (no copy of a large share); a copy where the file system has none."""
    try:
        os.link(source, target)
    except OSError:
        if not source.is_file():
            raise
        shutil.copy2(source, target)
