"""FlashRT ROS: the ROS 2 shell (policy node, conversions, capsule services, replay, CLI) over flashrt_core."""
import pkgutil

# The generated interfaces (flashrt_ros.msg / flashrt_ros.srv) are installed into the installed copy of
# this package; extending the package path lets a source checkout on sys.path still find them.
__path__ = pkgutil.extend_path(__path__, __name__)
