import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_addoption(parser):
    default = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    parser.addoption("--device", default=default, help="cpu or cuda (default: cuda when available)")
