# SPDX-License-Identifier: Apache-2.0
# Version of the meta-package. It ships no module; this file is read by hatch only.
__version__ = "0.1.0"
