"""Package discovery that honours the ``package-dir`` mapping (docs/architecture.md#layout).

``quant/``, ``kernels/`` and ``correctors/`` sit at the top of the checkout but install as
``jetrl_trainer.quant`` etc. setuptools' own ``packages.find`` cannot rename what it finds, and a
hand-kept list silently drops new subpackages from the wheel (it did: ``rollout``, ``diffusion``,
``tasks``). So every package below each mapped folder is found here, and named under its namespace.
"""

from setuptools import find_packages, setup

# Import name -> folder in the checkout.
PACKAGE_DIR = {
    "jetrl_trainer": "jetrl_trainer",
    "jetrl_trainer.quant": "quant",
    "jetrl_trainer.kernels": "kernels",
    "jetrl_trainer.correctors": "correctors",
}


def discover_packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIR.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]
    return packages


setup(package_dir=PACKAGE_DIR, packages=discover_packages())
