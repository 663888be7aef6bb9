"""Where systems live: a git repository under the controller's data directory.

Stock is the project's own ``specpilot_engine/`` and ``specpilot_kernels/`` (plus ``deployments/`` so a checkout can run
on its own) committed when a deployment is first registered. A candidate is its base commit with a
patch applied (``git apply``, never a shell); every promotion is a commit on the branch
``best/<deployment>``. After applying, the changed paths are checked again against the policy's
allowed roots, so a patch cannot reach further than its headers claimed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from specpilot.errors import UserError
from specpilot.paths import REPO_ROOT
from specpilot.policy import ALLOWED_ROOTS

SYSTEM_DIRS = ("specpilot_engine", "specpilot_kernels", "deployments")
_GIT_ENV = {"GIT_AUTHOR_NAME": "specpilot-controller", "GIT_AUTHOR_EMAIL": "controller@specpilot.local",
            "GIT_COMMITTER_NAME": "specpilot-controller", "GIT_COMMITTER_EMAIL": "controller@specpilot.local",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}


class PatchDoesNotApply(UserError):
    pass


class Systems:
    def __init__(self, root: Path):
        self.root = Path(root)

    def git(self, *args: str, input: str | None = None, cwd: Path | None = None) -> str:
        env = {**os.environ, **_GIT_ENV, "HOME": str(self.root)}
        res = subprocess.run(["git", *args], cwd=cwd or self.root, input=input, capture_output=True, text=True,
                             env=env, timeout=120)
        if res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, ["git", *args], res.stdout, res.stderr)
        return res.stdout.strip()

    # --- stock and branches ----------------------------------------------------------------------

    def ensure_stock(self, source: Path = REPO_ROOT) -> str:
        """Commit the project's engine as stock (once); returns the stock commit."""
        if (self.root / ".git").exists():
            return self.git("rev-parse", "stock")
        self.root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "stock")
        for d in SYSTEM_DIRS:
            shutil.copytree(source / d, self.root / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.git("add", "-A")
        self.git("commit", "-q", "-m", "stock: the project's engine, kernels and deployments")
        return self.git("rev-parse", "HEAD")

    def best(self, deployment: str) -> str:
        """The current best commit for a deployment (stock until something is promoted)."""
        try:
            return self.git("rev-parse", "--verify", "-q", f"refs/heads/best/{deployment}")
        except subprocess.CalledProcessError:
            return self.git("rev-parse", "stock")

    def advance(self, deployment: str, commit: str) -> str:
        """Point ``best/<deployment>`` at ``commit``; returns the previous best."""
        previous = self.best(deployment)
        self.git("update-ref", f"refs/heads/best/{deployment}", commit)
        return previous

    # --- candidates ------------------------------------------------------------------------------

    def apply(self, base: str, diff: str, message: str) -> str:
        """Commit ``diff`` applied on ``base``; returns the new commit (not on any branch)."""
        with tempfile.TemporaryDirectory(prefix="sp-apply-") as tmp:
            work = Path(tmp) / "w"
            self.git("worktree", "add", "-q", "--detach", str(work), base)
            try:
                if diff.strip():
                    try:
                        self.git("apply", "--whitespace=nowarn", "-", input=diff, cwd=work)
                    except subprocess.CalledProcessError as exc:
                        raise PatchDoesNotApply(f"the patch does not apply on {base[:12]}: {exc.stderr.strip()}") from exc
                self.git("add", "-A", cwd=work)
                self.git("commit", "-q", "--allow-empty", "-m", message, cwd=work)
                commit = self.git("rev-parse", "HEAD", cwd=work)
            finally:
                self.git("worktree", "remove", "--force", str(work))
        changed = self.git("diff", "--name-only", base, commit).splitlines()
        outside = [p for p in changed if not p.startswith(ALLOWED_ROOTS)]
        if outside:
            raise PatchDoesNotApply(f"applied patch changed files outside {ALLOWED_ROOTS}: {outside}")
        return commit

    def checkout(self, commit: str, dest: Path) -> Path:
        """Write the tree of ``commit`` into ``dest`` (a fresh directory)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=self.root, capture_output=True,
                                 check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=120)
        return dest

    def diff(self, base: str, commit: str) -> str:
        return self.git("diff", base, commit)


def export_system(data: Path, deployment: str, dest: Path) -> dict:
    """Write the best system of ``deployment`` for use outside SpecPilot: its tree (``specpilot_engine/``,
    ``specpilot_kernels/``, ``deployments/``), ``final.patch`` (its diff against stock, apply with ``git apply``
    in a SpecPilot checkout) and ``options.json`` (the engine option settings it runs with)."""
    import json

    root = Path(data) / "controller" / "systems"
    if not (root / ".git").exists():
        raise UserError(f"no systems under {root}: run `specpilot round` (or `specpilot time`) first")
    systems = Systems(root)
    best, stock = systems.best(deployment), systems.git("rev-parse", "stock")
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest} is not empty: choose a new folder")
    systems.checkout(best, dest)
    (dest / "final.patch").write_text(systems.diff(stock, best) + "\n" if best != stock else "")
    try:
        options = json.loads((root.parent / "state.json").read_text()).get("best_options", {}).get(deployment, {})
    except (FileNotFoundError, ValueError):
        options = {}
    (dest / "options.json").write_text(json.dumps(options, indent=2) + "\n")
    return {"deployment": deployment, "commit": best, "stock": stock, "dir": str(dest), "options": options}
