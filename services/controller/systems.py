"""Where systems live: a git repository under the controller's data directory.

Stock is the project's own runtime, ``engine/`` and ``kernels/`` (`SYSTEM_DIRS`), committed when a
deployment is first registered and again whenever the checkout's runtime has changed since (`restock`: an
upgraded or edited SpecPilot, or a repository made by an earlier version, whose runtime folders had other
names; each best branch is carried onto the new stock); the harness that runs it (worker, deployments,
request sets) is never part of a system. A candidate is its base commit with a patch applied (``git
apply``, never a shell; a diff recorded with 0.2's folder names is read with today's:
`policy.current_paths`); every promotion is a commit on the branch ``best/<deployment>``. After applying,
the changed paths are checked again against the policy's allowed roots, so a patch cannot reach further
than its headers claimed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from pathlib import Path

from specpilot.errors import UserError
from specpilot.layout import RUNTIME_FOLDERS
from specpilot.paths import REPO_ROOT
from specpilot.policy import ALLOWED_ROOTS, current_paths

SYSTEM_DIRS = RUNTIME_FOLDERS
_CACHE_PATHSPECS = (":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc", ":(exclude,glob)**/.pytest_cache/**")
log = logging.getLogger("controller")
_GIT_ENV = {"GIT_AUTHOR_NAME": "specpilot-controller", "GIT_AUTHOR_EMAIL": "controller@specpilot.local",
            "GIT_COMMITTER_NAME": "specpilot-controller", "GIT_COMMITTER_EMAIL": "controller@specpilot.local",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0"}


class PatchDoesNotApply(UserError):
    pass


class Systems:
    def __init__(self, root: Path):
        self.root = Path(root)

    def git(self, *args: str, input: str | None = None, cwd: Path | None = None, env: dict | None = None,
            strip: bool = True) -> str:
        env = {**os.environ, **_GIT_ENV, "HOME": str(self.root), **(env or {})}
        res = subprocess.run(["git", *args], cwd=cwd or self.root, input=input, capture_output=True, text=True,
                             env=env, timeout=120)
        if res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, ["git", *args], res.stdout, res.stderr)
        return res.stdout.strip() if strip else res.stdout

    # --- stock and branches ----------------------------------------------------------------------

    def ensure_stock(self, source: Path = REPO_ROOT) -> str:
        """Commit the project's engine as stock (once, then again when it changes: `restock`); returns the
        stock commit."""
        if (self.root / ".git").exists():
            return self.restock(source)
        self.root.mkdir(parents=True, exist_ok=True)
        self.git("init", "-q", "-b", "stock")
        # the same tree `restock` compares against, so a fresh stock is never restocked at once
        stock = self.git("commit-tree", self.source_tree(source), "-m",
                         f"stock: the project's runtime ({', '.join(SYSTEM_DIRS)})")
        self.git("update-ref", "refs/heads/stock", stock)
        self.git("reset", "-q", "--hard", "stock")
        return stock

    def source_tree(self, source: Path) -> str:
        """The git tree id of the runtime in ``source`` as stock would commit it (caches left out)."""
        with tempfile.TemporaryDirectory(prefix="sp-stock-") as tmp:
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            self.git("--work-tree", str(source), "add", "-A", "--", *SYSTEM_DIRS, *_CACHE_PATHSPECS, env=env)
            return self.git("write-tree", env=env)

    def restock(self, source: Path = REPO_ROOT) -> str:
        """Stock follows the checkout: when the runtime in ``source`` differs from stock's, it is committed on
        the stock branch (the old stock its parent) and each ``best/<deployment>`` is carried over, its diff
        from the old stock applied to the new one (one that no longer applies restarts from the new stock, as
        in `migrate`); ``refs/migrated/<old>`` leads each old commit to its carried one, so the ledger's
        bests and patches written on the old stock resolve (`resolve`). Returns the (new) stock commit."""
        old = self.git("rev-parse", "stock")
        tree = self.source_tree(source)
        if tree == self.git("rev-parse", f"{old}^{{tree}}"):
            return old
        new = self.git("commit-tree", tree, "-p", old, "-m", f"stock: the runtime in {source} changed")
        self.git("update-ref", "refs/heads/stock", new)
        self.git("reset", "-q", "--hard", "stock")  # the repository's own work tree follows its branch
        self.git("update-ref", f"refs/migrated/{old}", new)
        for branch in self.git("for-each-ref", "--format=%(refname:short)", "refs/heads/best/").split():
            previous = self.git("rev-parse", branch)
            carried = new
            if previous != old:
                try:
                    carried = self.apply(new, self.diff(old, previous), f"{branch} carried to the new stock")
                except PatchDoesNotApply as exc:
                    log.warning("%s: its code change does not apply to the new stock, so it restarts from it "
                                "(its options stay): %s", branch, exc)
            self.git("update-ref", f"refs/heads/{branch}", carried)
            self.git("update-ref", f"refs/migrated/{previous}", carried)
        log.info("stock %s -> %s: the runtime in %s changed", old[:12], new[:12], source)
        return new

    def best(self, deployment: str) -> str:
        """The current best commit for a deployment (stock until something is promoted)."""
        try:
            return self.git("rev-parse", "--verify", "-q", f"refs/heads/best/{deployment}")
        except subprocess.CalledProcessError:
            return self.git("rev-parse", "stock")

    def resolve(self, commit: str) -> str | None:
        """What `migrate` or `restock` carried ``commit`` over to (through every later restock), else
        ``commit`` if the repository has it, else None."""
        seen: set[str] = set()
        while commit not in seen:
            seen.add(commit)
            try:
                commit = self.git("rev-parse", "--verify", "-q", f"refs/migrated/{commit}")
            except subprocess.CalledProcessError:
                break
        try:
            return self.git("rev-parse", "--verify", "-q", f"{commit}^{{commit}}")
        except subprocess.CalledProcessError:
            return None

    def advance(self, deployment: str, commit: str) -> str:
        """Point ``best/<deployment>`` at ``commit``; returns the previous best."""
        previous = self.best(deployment)
        self.git("update-ref", f"refs/heads/best/{deployment}", commit)
        return previous

    # --- candidates ------------------------------------------------------------------------------

    def apply(self, base: str, diff: str, message: str) -> str:
        """Commit ``diff`` applied on ``base``; returns the new commit (not on any branch)."""
        diff = current_paths(diff)
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

    def integrate(self, best: str, base: str, diff: str, message: str) -> str:
        """Commit ``diff``, written against ``base``, onto ``best``: applied on ``base`` and cherry-picked
        (a 3-way merge) when the best has moved on since (another promotion of the same wave), applied
        on ``best`` directly otherwise. A conflict is a `PatchDoesNotApply` naming both commits."""
        base = self.resolve(base) if base else None
        if base is None or base == best or not diff.strip():
            return self.apply(best, diff, message)
        own = self.apply(base, diff, message)
        with tempfile.TemporaryDirectory(prefix="sp-integrate-") as tmp:
            work = Path(tmp) / "w"
            self.git("worktree", "add", "-q", "--detach", str(work), best)
            try:
                try:
                    self.git("cherry-pick", "--allow-empty", own, cwd=work)
                except subprocess.CalledProcessError as exc:
                    raise PatchDoesNotApply(
                        f"the patch (written on {base[:12]}) conflicts with the best {best[:12]} it would join: "
                        f"{(exc.stdout + exc.stderr).strip()[-400:]}") from exc
                return self.git("rev-parse", "HEAD", cwd=work)
            finally:
                self.git("worktree", "remove", "--force", str(work))

    def checkout(self, commit: str, dest: Path) -> Path:
        """Write the tree of ``commit`` into ``dest`` (a fresh directory)."""
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=self.root, capture_output=True,
                                 check=True, timeout=120).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=120)
        return dest

    def diff(self, base: str, commit: str) -> str:
        """The unified diff from ``base`` to ``commit``, as git wrote it (a patch's last context line may be
        a lone space: stripping would corrupt it)."""
        return self.git("diff", base, commit, strip=False)

    def trees(self, commit: str) -> dict[str, str]:
        """The git tree id of each runtime root at ``commit``: equal ids, equal files (and modes)."""
        return {root: self.git("rev-parse", f"{commit}:{root}") for root in SYSTEM_DIRS}


def export_system(data: Path, deployment: str, dest: Path, options_of) -> dict:
    """Write the best system of ``deployment`` for use outside SpecPilot: its tree (``engine/``,
    ``kernels/``), ``final.patch`` (its diff against stock, apply with ``git apply`` in a
    SpecPilot checkout) and ``options.json`` (the engine option settings it runs with:
    ``options_of(commit)``, which the caller answers from the ledger)."""
    root = Path(data) / "controller" / "systems"
    if not (root / ".git").exists():
        raise UserError(f"no systems under {root}: run `specpilot round` (or `specpilot time`) first")
    systems = Systems(root)
    best, stock = systems.best(deployment), systems.git("rev-parse", "stock")
    dest = export_destination(dest)
    options = options_of(best) if best != stock else {}
    systems.checkout(best, dest)
    write_export(dest, systems.diff(stock, best) if best != stock else "", options)
    return {"deployment": deployment, "commit": best, "stock": stock, "dir": str(dest), "options": options}


def export_destination(dest: Path | str) -> Path:
    """``dest`` for an exported system: absent or empty, else `UserError`."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UserError(f"{dest} is not empty: choose a new folder")
    return dest


def write_export(dest: Path, diff: str, options: dict) -> None:
    """Beside an exported system's tree: ``final.patch`` (its diff against stock) and ``options.json``."""
    import json

    (dest / "final.patch").write_text(diff)
    (dest / "options.json").write_text(json.dumps(options, indent=2) + "\n")


def migrate(data: Path, source: Path = REPO_ROOT) -> list[str]:
    """Bring a data directory's systems repository to this version's runtime now; what it did. The
    controller does the same when it starts (`Systems.restock`): stock is committed anew from ``source``
    (the old stock its parent, so ``git log`` keeps the history) and each ``best/<deployment>`` is carried
    over by re-applying its diff against the old stock with the folders named as today (``engine/``,
    ``kernels/``); a branch whose diff no longer applies (a change to 0.1's worker, which is harness now)
    restarts from stock with its options, and the result says so. The ledger is untouched: its events keep
    naming the old commits, which `Systems.resolve` leads to the carried ones."""
    root = Path(data) / "controller" / "systems"
    if not (root / ".git").exists():
        return [f"nothing to migrate: no systems repository under {root}"]
    systems = Systems(root)
    old = systems.git("rev-parse", "stock")
    branches = {b.removeprefix("best/"): systems.git("rev-parse", b)
                for b in systems.git("for-each-ref", "--format=%(refname:short)", "refs/heads/best/").split() if b}
    stock = systems.ensure_stock(source)
    if stock == old:
        return [f"nothing to migrate: {root} already holds this version's runtime"]
    done = [f"committed stock {stock[:12]} from {source} (was {old[:12]})"]
    for dep, previous in sorted(branches.items()):
        now = systems.best(dep)
        if previous == old:
            done.append(f"best/{dep}: no code change (options only), it stays at stock")
        elif now == stock:
            done.append(f"best/{dep}: its code change does not apply to this version; it restarts from stock with "
                        "its options (the old commit stays in the repository)")
        else:
            done.append(f"best/{dep}: carried over as {now[:12]}")
    return done
