"""The agent policy every berth process of the test suite runs under.

Tests run models from their own folders (``tmp_path``, under the system's temporary folder)
and from the bundled SmolLM2 GGUF in the virtual environment, and run containers from the
images ``support/docker_support.py`` builds (``berth-test/*``).  The default policy allows
none of them (model roots under ``$BERTH_HOME/models`` and the Hugging Face cache; the
official images), so the suite gives every leader and agent a policy that does, through the
``[agent_policy]`` settings' environment variables (:func:`policy_env`): ``conftest.py``
puts them in this process's environment, and ``cluster_harness.clean_env`` keeps them.  The
shipped default is untouched; the tests of the policy itself give agents their own.
"""

from __future__ import annotations

import sys
import tempfile

from berth.vocab.agent_policy import DEFAULT_IMAGE_PATTERNS

#: Images the suite builds for its containers (``support/docker_support.py``).
TEST_IMAGES = "berth-test/*"


def policy_env() -> dict[str, str]:
    """``BERTH_POLICY_*`` for the suite: model roots at the temporary folder and this
    virtual environment, the default images and the suite's own."""
    roots = [tempfile.gettempdir(), sys.prefix]
    return {
        "BERTH_POLICY_MODEL_ROOTS": ",".join(roots),
        "BERTH_POLICY_IMAGES": ",".join([*DEFAULT_IMAGE_PATTERNS, TEST_IMAGES]),
    }
