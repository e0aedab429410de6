"""Fixtures shared by several test modules."""
import pytest


@pytest.fixture(scope="session")
def eight_gpu_root(tmp_path_factory):
    """Records of an h200-x8 platform beside the committed h200-x2 ones
    (``synthetic.write_eight_gpu_beside_committed``); read only."""
    from tests.synthetic import write_eight_gpu_beside_committed

    root = tmp_path_factory.mktemp("records")
    write_eight_gpu_beside_committed(root)
    return root
