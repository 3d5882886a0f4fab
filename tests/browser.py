"""A headless Chromium for tests that drive the Airflow UI: Debian's chromium and its matching
chromedriver (installed with apt-get on first use when missing and root; otherwise the test is
skipped with the reason), through selenium."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("chromium", "chromium-driver")


def artifacts_dir() -> Path:
    """Where tests keep what a person looks at afterwards (screenshots): ``$TG_ARTIFACTS`` or
    ``artifacts/`` in the repository (not tracked)."""
    path = Path(os.environ.get("TG_ARTIFACTS") or REPO / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _binaries() -> tuple[str | None, str | None]:
    return shutil.which("chromium"), shutil.which("chromedriver")


def ensure_chromium() -> tuple[str, str]:
    """The chromium and chromedriver binaries; installs the Debian packages when they are missing."""
    browser, driver = _binaries()
    if browser and driver:
        return browser, driver
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"needs {' and '.join(PACKAGES)} (apt-get install {' '.join(PACKAGES)}) or root to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode:  # the package lists may be stale: refresh once
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600, check=False)
        proc = subprocess.run(["apt-get", "install", "-y", "-q", *PACKAGES], env=env,
                              capture_output=True, text=True, timeout=900, check=False)
    browser, driver = _binaries()
    if proc.returncode or not (browser and driver):
        raise RuntimeError(f"installing {' '.join(PACKAGES)} failed: {(proc.stderr or proc.stdout)[-500:]}")
    return browser, driver


def chrome(width: int = 1400, height: int = 1000) -> Any:
    """A headless Chromium WebDriver (the caller quits it)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    d = webdriver.Chrome(options=options, service=Service(driver))
    d.set_page_load_timeout(120)
    return d


def login(d: Any, airflow: Any, timeout: float = 120) -> None:
    """Log ``d`` into the Airflow UI of ``airflow`` (a :class:`trainguard.emulation.standalone.Standalone`) as
    its generated admin user."""
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    password = json.loads((airflow.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    wait = WebDriverWait(d, timeout)
    d.get(f"{airflow.url}/auth/login")
    wait.until(ec.presence_of_element_located((By.NAME, "username"))).send_keys("admin")
    d.find_element(By.NAME, "password").send_keys(password)
    d.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(lambda drv: "/auth/login" not in drv.current_url)
