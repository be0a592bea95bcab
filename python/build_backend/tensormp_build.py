"""The PEP 517 build backend of the tensormp Python package.

It builds libtensormp.so with the Go toolchain (``go build
-buildmode=c-shared ./cmd/libtensormp``) and puts it in the wheel beside
the package's Python files. It needs nothing but the Python standard
library and ``go`` on $PATH (or $GO), so it builds the same with and
without build isolation, and with no package index in reach.

The Go sources are those of the module at the root of the repository
that holds this package's folder, or, in an sdist, of the ``go/`` folder
beside ``pyproject.toml``: build_sdist copies them there.
"""

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

try:
    import tomllib
except ImportError:  # Python before 3.11
    import tomli as tomllib

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)  # the folder of pyproject.toml
_MODULE = "github.com/tensormp/tensormp"
_PACKAGE = "tensormp"
_LIBRARY = "libtensormp.so"

# What build_sdist takes from the Go module: the sources of the core
# module's packages, without tests and test data, the nested dist module,
# this package, the command-line tool and the repository's tooling.
_GO_SKIP_DIRS = {".git", ".ci", "dist", "python", "tests", "cmd/spawn"}
_GO_FILES = re.compile(r"(go\.mod|go\.sum|.*\.(go|h|c|s))$")


class BuildError(Exception):
    """The package could not be built; the message says why."""


def _project():
    """Returns pyproject.toml's [project] table."""
    with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f).get("project", {})
    for key in ("name", "version"):
        if not isinstance(project.get(key), str):
            raise BuildError(f"pyproject.toml: [project] has no {key}")
    return project


def _dist_name(project):
    return re.sub(r"[-_.]+", "_", project["name"]).lower() + "-" + project["version"]


def _metadata(project):
    """Returns the core metadata (PKG-INFO, METADATA) of the project."""
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    if project.get("keywords"):
        lines.append("Keywords: " + ",".join(project["keywords"]))
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    for extra, reqs in sorted(project.get("optional-dependencies", {}).items()):
        lines.append(f"Provides-Extra: {extra}")
        lines.extend(f'Requires-Dist: {r}; extra == "{extra}"' for r in reqs)
    body = ""
    readme = project.get("readme")
    if isinstance(readme, str):
        lines.append("Description-Content-Type: text/markdown")
        with open(os.path.join(_ROOT, readme), encoding="utf-8") as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _go_root():
    """Returns the root of the Go module to build the library from."""
    for root in (os.path.join(_ROOT, "go"), os.path.dirname(_ROOT)):
        try:
            with open(os.path.join(root, "go.mod"), encoding="utf-8") as f:
                first = f.readline().split()
        except FileNotFoundError:
            continue
        if first == ["module", _MODULE]:
            return root
    raise BuildError(
        f"tensormp: no Go module {_MODULE} in {os.path.join(_ROOT, 'go')} "
        f"or {os.path.dirname(_ROOT)}: build from the repository or from an sdist")


def _build_library(out_dir):
    """Builds libtensormp.so into out_dir and returns its path."""
    go = os.environ.get("GO") or shutil.which("go")
    if not go:
        raise BuildError("tensormp: building libtensormp.so needs the Go toolchain: "
                         "no go on $PATH (or set $GO)")
    out = os.path.join(out_dir, _LIBRARY)
    env = dict(os.environ, CGO_ENABLED="1", GOWORK="off")
    cmd = [go, "build", "-buildmode=c-shared", "-trimpath", "-o", out, "./cmd/libtensormp"]
    print("tensormp: " + " ".join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, cwd=_go_root(), env=env)
    if done.returncode != 0:
        raise BuildError(f"tensormp: go build of libtensormp.so failed (exit status {done.returncode})")
    return out


def _package_files():
    """Yields (path in the archive, path here) of the package's Python files."""
    pkg = os.path.join(_ROOT, _PACKAGE)
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py") or name == "py.typed":
            yield f"{_PACKAGE}/{name}", os.path.join(pkg, name)


def _tag():
    # The library is native code for this machine; the Python side is
    # ctypes, bound to no Python version or ABI.
    plat = re.sub(r"[-.]", "_", sysconfig.get_platform())
    return f"py3-none-{plat}"


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _write_dist_info(directory, project):
    """Writes the dist-info folder's METADATA and WHEEL into directory and
    returns the folder's name."""
    info = _dist_name(project) + ".dist-info"
    os.makedirs(os.path.join(directory, info), exist_ok=True)
    files = {
        "METADATA": _metadata(project),
        "WHEEL": f"Wheel-Version: 1.0\nGenerator: tensormp_build\nRoot-Is-Purelib: false\nTag: {_tag()}\n",
        "top_level.txt": _PACKAGE + "\n",
    }
    for name, text in files.items():
        with open(os.path.join(directory, info, name), "w", encoding="utf-8") as f:
            f.write(text)
    return info


# PEP 517 hooks.

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _write_dist_info(metadata_directory, _project())


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    name = f"{_dist_name(project)}-{_tag()}.whl"
    with tempfile.TemporaryDirectory(prefix="tensormp-wheel") as tmp:
        entries = list(_package_files())
        entries.append((f"{_PACKAGE}/{_LIBRARY}", _build_library(tmp)))
        info = _write_dist_info(tmp, project)
        for meta in sorted(os.listdir(os.path.join(tmp, info))):
            entries.append((f"{info}/{meta}", os.path.join(tmp, info, meta)))
        record = io.StringIO()
        rows = csv.writer(record, lineterminator="\n")
        path = os.path.join(wheel_directory, name)
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
            for arc, src in entries:
                with open(src, "rb") as f:
                    data = f.read()
                whl.writestr(_zip_info(arc, src), data)
                rows.writerow([arc, _record_hash(data), len(data)])
            rows.writerow([f"{info}/RECORD", "", ""])
            whl.writestr(_zip_info(f"{info}/RECORD", None), record.getvalue())
    return name


def _zip_info(arc, src):
    """Returns a ZipInfo for arc, with src's permission bits (0644 if none)
    and a fixed date, so that a build's wheel depends on its inputs alone."""
    zi = zipfile.ZipInfo(arc, date_time=(1980, 1, 1, 0, 0, 0))
    mode = os.stat(src).st_mode & 0o777 if src else 0o644
    zi.external_attr = (0o100000 | mode) << 16
    zi.compress_type = zipfile.ZIP_DEFLATED
    return zi


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    base = _dist_name(project)
    go_root = _go_root()
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as tar:
        def add(arc, src):
            info = tar.gettarinfo(src, f"{base}/{arc}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(src, "rb") as f:
                tar.addfile(info, f)

        for arc in ("pyproject.toml", "README.md", "build_backend/tensormp_build.py"):
            add(arc, os.path.join(_ROOT, arc))
        for arc, src in _package_files():
            add(arc, src)
        for arc, src in _go_sources(go_root):
            add("go/" + arc, src)
        pkg_info = _metadata(project).encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return name


def _go_sources(root):
    """Yields (path in the module, path here) of what the library's build
    reads from the Go module at root."""
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames
                             if d != "testdata" and os.path.normpath(os.path.join(rel, d)) not in _GO_SKIP_DIRS)
        for name in sorted(filenames):
            if _GO_FILES.fullmatch(name) and not name.endswith("_test.go"):
                yield os.path.normpath(os.path.join(rel, name)), os.path.join(dirpath, name)
