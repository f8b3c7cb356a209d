"""The gradagg Python package, for pip: `pip install --no-build-isolation .` from a clone.

CMake builds only the library and the _core module (no tests, bench or examples), with the
project's own flags, in build/pip/ (kept, so a second install is quick); setuptools then installs
python/gradagg/*.py and _core with pip's metadata, so `pip show gradagg` and `pip uninstall
gradagg` work. The version is CMakeLists.txt's project(gradagg VERSION ...).
"""
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


def cmake_version():
    with open(os.path.join(HERE, "CMakeLists.txt"), encoding="utf-8") as f:
        return re.search(r"project\(gradagg VERSION ([0-9.]+)", f.read()).group(1)


class CMakeBuild(build_ext):
    """Builds the gradagg_python target with CMake and puts _core where setuptools wants it."""

    def build_extension(self, ext):
        if shutil.which("cmake") is None:
            sys.exit("gradagg: cmake not found (Debian: apt-get install cmake)")
        build = os.environ.get("GRADAGG_PIP_BUILD_DIR", os.path.join(HERE, "build", "pip"))
        jobs = os.environ.get("GRADAGG_PIP_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call([
            "cmake", "-S", HERE, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
            "-DGRADAGG_BUILD_TESTS=OFF", "-DGRADAGG_BUILD_EXAMPLES=OFF", "-DGRADAGG_BUILD_BENCH=OFF",
            "-DGRADAGG_BUILD_PYTHON=ON", f"-DPYTHON_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", build, "-j", jobs, "--target", "gradagg_python"])
        built = [f for f in os.listdir(os.path.join(build, "python", "gradagg"))
                 if f.startswith("_core") and f.endswith(".so")]
        if len(built) != 1:
            sys.exit(f"gradagg: expected one _core module in {build}/python/gradagg, found {built}")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(os.path.join(build, "python", "gradagg", built[0]), target)


setup(
    version=cmake_version(),
    packages=["gradagg"],
    package_dir={"gradagg": "python/gradagg"},
    ext_modules=[Extension("gradagg._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
