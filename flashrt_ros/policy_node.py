"""policy_node: a lifecycle node that runs a flashrt_core Runtime on camera and joint-state topics.

configure: load the contract, the model and its buffers (a bad checkpoint or contract fails the
transition with the reason and the node stays alive, unconfigured); activate: one timer per rate stage
of the contract; deactivate: stop the timers; cleanup: free the runtime (and its GPU memory).
Sensor callbacks only store the latest message. The stage timers only wake an inference thread of the
node's own (the decision never runs in, nor blocks, the executor that serves sensors and services); capsule
services take the runtime lock, so they are applied between two ticks.
"""
from __future__ import annotations

import signal
import threading
import time

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy
from rclpy.lifecycle import Node as LifecycleNode
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from rclpy.duration import Duration
from rclpy.event_handler import PublisherEventCallbacks
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float64MultiArray, String
from trajectory_msgs.msg import JointTrajectory

from flashrt_core.contract.bindings import image_pad
from flashrt_core.lerobot.preprocess import letterbox
from flashrt_ros import conversions, params, setup_checks
from flashrt_ros.capsule_services import CapsuleServices
from flashrt_ros.chunk_messages import action_chunk_message, trajectory_message
from flashrt_ros.diagnostics import ClockWatch, NodeHealth, refusal_reason
from flashrt_ros.frame_fitter import FrameFitter
from flashrt_ros.msg import ActionChunk
from flashrt_ros.runtime_loader import action_names, load_runtime


DEADLINE_PERIODS = 1.5  # the action chunk's QoS deadline, in act periods
FUTURE_STAMP_MS = 1000.0  # how far ahead of the node's clock a sensor stamp may be without an age limit
CLOCK_JUMP_NS = 1_000_000  # the node's clock going back by more than this is a reset (e.g. of a simulation)
RESET_SKEW_NS = 50_000_000  # after a reset, messages stamped further than this past the node's clock are old
LOG_EVERY_S = 2.0  # a refused source's warning is logged at most this often (each source on its own)
STOP_POLL_S = 0.1  # the executor returns at least this often to see a Ctrl-C


class PolicyNode(LifecycleNode):
    def __init__(self, name: str = "policy_node", **kwargs):
        super().__init__(name, **kwargs)
        self._parameter_errors = params.declare(self)  # overrides of a wrong type: configure fails with them
        self.p = None
        self.runtime = None
        self.runtime_lock = threading.Lock()
        self.health = NodeHealth()
        self._publish_error = ""  # set by _publish_safely (inside a step), reported by _tick
        # Inference runs in a thread of its own, woken by the stage timers. (rclpy's multi-threaded executor
        # was tried: it busy-polls ready callbacks of busy groups and starves the decision of the GIL.)
        self._wake = threading.Condition()
        self._wake_pending = False
        self._ticking = False  # the inference thread is in a tick (a wake now is an overrun)
        self._future_limit_ns = int(FUTURE_STAMP_MS * 1e6)  # set from the contract's age limit at configure
        self._age_limit_ns = None  # the contract's max observation age (None: no limit), set at configure
        self._started_ns = None  # the node's clock at activate (None while a simulated clock reads 0)
        self._last_tick_ns = None  # the node's clock at the last tick (a jump back is a clock reset)
        self._fresh_since_reset = True  # an observation stamped on the current clock was fed
        self._worker = None
        self._worker_stop = False
        self._sensor_lock = threading.Lock()
        self._images: dict[int, tuple[np.ndarray, int]] = {}
        self._frames = FrameFitter(self._sensor_lock, self._fit_frame, self._refuse, self._store_frame)
        self._joints: tuple[np.ndarray, int] | None = None
        self._last_stamp: dict[str, int] = {}
        self._fed_stamp = -1
        self._frame_shape = None
        self._frame_pad = "centre"  # (the model's: contract.bindings.image_pad)
        self._state_dim: int | None = None
        self._action_names: list[str] = []
        self._dirty = False
        self.finalized = False  # set by the shutdown transition
        self._grey_topics: set[str] = set()  # camera topics that sent one-channel frames (warned of once)
        self._stage_timers = []
        self._logged_refusal: dict[str, float] = {}  # source -> when its last refusal was logged
        self._subs = []
        self._chunk_pub = self._traj_pub = None
        self._diag_timer = None
        self.capsules = CapsuleServices(self)
        self._parameter_errors.update(self.capsules.parameter_errors)
        self._unknown_parameters = setup_checks.undeclared_overrides(self)
        for warning in self._unknown_parameters:  # (a wrong type is said once, by the configure it fails)
            self.get_logger().warning(warning)
        self._prompt_echo = False  # set_parameters of a prompt the runtime already took (from ~/prompt)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        # raw: a NUL byte or invalid UTF-8 is refused, not cut or replaced by rclpy's conversion
        self.create_subscription(String, "~/prompt", self._on_prompt_bytes, 10, raw=True)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # on the steady clock: /diagnostics goes on (and says so) when ROS time stands still (use_sim_time, no /clock)
        self._clock_watch = ClockWatch()
        self._diag_timer = self.create_timer(1.0, self._publish_diagnostics,
                                             clock=Clock(clock_type=ClockType.STEADY_TIME))
        if self.get_parameter("autostart").value:
            # Deferred to the first spin so that the node is fully constructed and discoverable.
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    # ----------------------------------------------------------------- lifecycle
    def _autostart(self):
        self._autostart_timer.cancel()
        ok = self.trigger_configure() == TransitionCallbackReturn.SUCCESS
        ok = ok and self.trigger_activate() == TransitionCallbackReturn.SUCCESS
        if not ok and self.get_parameter("exit_on_failure").value:
            # (flashrt run: a process that cannot run its policy ends, with the reason logged above)
            raise SystemExit(f"policy_node {self.get_fully_qualified_name()}: {self.health.last_error or 'failed'}")

    def on_configure(self, state) -> TransitionCallbackReturn:
        try:
            if self._parameter_errors:  # (a wrong type in the params file; `ros2 param set` may fix it)
                raise ValueError("; ".join(self._parameter_errors.values()))
            self.p = params.read(self)
            runtime = load_runtime(self.p, n_cameras=len(self.p.camera_topics))
            self.capsules.configure(runtime)  # capsule_* parameters (closes the runtime if they are bad)
        except Exception as exc:  # any failure: report it and stay unconfigured
            self.health.last_error = f"configure failed: {exc}"
            self.get_logger().error(self.health.last_error)
            return TransitionCallbackReturn.FAILURE
        try:
            if self.p.prompt:
                runtime.set_prompt(self.p.prompt)
        except Exception as exc:  # a bad prompt parameter: report it, free the runtime, stay unconfigured
            runtime.close()
            self.health.last_error = f"configure failed: prompt parameter: {exc}"
            self.get_logger().error(self.health.last_error)
            return TransitionCallbackReturn.FAILURE
        with self.runtime_lock:
            self.runtime = runtime
            self._frame_shape = tuple(runtime.contract.buffers["images"].shape[1:])
            self._frame_pad = image_pad(runtime.contract.model)
            self._state_dim = runtime.contract.buffers["state"].shape[0]
            # chunk columns are named by the checkpoint's action names where it has them, else by joint_names
            self._action_names = action_names(runtime) or list(self.p.joint_names)
            limit = runtime.contract.limits.max_observation_age_ms
            self._future_limit_ns = int((limit if limit is not None else FUTURE_STAMP_MS) * 1e6)
            self._age_limit_ns = int(limit * 1e6) if limit is not None else None
        self.health.last_error = ""
        found = setup_checks.configured_warnings(self.p, runtime)
        self.health.setup_warnings = self._unknown_parameters + found
        self._grey_topics = set()  # (said again for this configuration)
        self._frames.budget(self.p.camera_pixel_budget_mpx_s * 1e6)
        for warning in found:
            self.get_logger().warning(warning)
        self._diag_timer.timer_period_ns = int(self.p.diagnostics_period_s * 1e9)
        # Reliable, with a deadline of 1.5 act periods: a period and a half without a chunk (not ordinary
        # timer jitter) raises the middleware's offered-deadline-missed event, counted in /diagnostics.
        period = DEADLINE_PERIODS / runtime.stage_rates()[runtime.scheduler.output_stage]
        chunk_qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                               durability=DurabilityPolicy.VOLATILE, deadline=Duration(seconds=period))
        self._chunk_pub = self.create_lifecycle_publisher(
            ActionChunk, "~/action_chunk", chunk_qos,
            event_callbacks=PublisherEventCallbacks(deadline=self._on_chunk_deadline_missed))
        if self.p.publish_joint_trajectory:
            self._traj_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 10)
        self._subscribe_sensors()
        self.get_logger().info(
            f"configured: {runtime.describe()} cameras={self.p.camera_topics} joints={self.p.joint_names or 'as sent'} "
            f"(warm-up {runtime.warmup_s or 0.0:.1f} s)")
        if not self.p.prompt and "prompt" in runtime.contract.buffers:
            self.get_logger().warning(f"no prompt yet: no actions until a task arrives on "
                                      f"{self.resolve_topic_name('~/prompt')} (or set the `prompt` parameter)")
        if not runtime.contract.model.checkpoint:
            self.get_logger().warning("no checkpoint: the model has built-in random weights and its actions are "
                                      "noise (for demos and tests); set the `checkpoint` parameter to run a policy")
        self.health.lifecycle = "inactive"
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state) -> TransitionCallbackReturn:
        for stage, rate in self.runtime.stage_rates().items():
            self._stage_timers.append(self.create_timer(1.0 / rate, self._wake_worker))
        self._worker_stop = False
        self._started_ns = self.get_clock().now().nanoseconds or None
        self._worker = threading.Thread(target=self._inference_loop, name="flashrt_inference", daemon=True)
        self._worker.start()
        self.get_logger().info(f"active: stage rates {self.runtime.stage_rates()}")
        self.health.lifecycle = "active"
        return super().on_activate(state)

    def on_deactivate(self, state) -> TransitionCallbackReturn:
        self._stop_timers()
        self.health.lifecycle = "inactive"
        self.get_logger().info("inactive: stage timers stopped, no actions published (activate to resume)")
        return super().on_deactivate(state)

    def on_cleanup(self, state) -> TransitionCallbackReturn:
        self._release()
        self.get_logger().info("unconfigured: the runtime and its memory are freed (configure to load it again)")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state) -> TransitionCallbackReturn:
        self._release()
        self.health.lifecycle = "finalized"
        self.finalized = True  # (main() ends the process: a finalized lifecycle node can do nothing more)
        self.get_logger().info("finalized: shut down (the process ends)")
        return TransitionCallbackReturn.SUCCESS

    def _release(self) -> None:
        """Stop the timers, drop the sensor subscriptions and publishers and close the runtime (cleanup and
        shutdown)."""
        self._stop_timers()
        self.health.lifecycle = "unconfigured"
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs.clear()
        for pub in (self._chunk_pub, self._traj_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._chunk_pub = self._traj_pub = None
        with self.runtime_lock:  # (a capsule call that starts from now on answers "not configured")
            runtime, self.runtime = self.runtime, None
        if not self.capsules.idle():  # (a capsule call still at its files: it fails once the runtime is closed)
            self.get_logger().warning("cleanup: a capsule call still runs; closing the runtime under it")
        if runtime is not None:
            runtime.close()
        with self._sensor_lock:
            self._images.clear()
            self._frames.drop()
            self._joints = None
            self._last_stamp.clear()
            self._fed_stamp = -1
        self._last_tick_ns, self._fresh_since_reset = None, True

    def _on_chunk_deadline_missed(self, info):
        self.health.deadline_misses = int(info.total_count)

    def _stop_timers(self):
        for timer in self._stage_timers:
            self.destroy_timer(timer)
        self._stage_timers.clear()
        if self._worker is not None:
            with self._wake:
                self._worker_stop = True
                self._wake.notify()
            self._worker.join()
            self._worker = None

    # ----------------------------------------------------------------- inputs
    def _subscribe_sensors(self):
        for index, topic in enumerate(self.p.camera_topics):
            msg_type = CompressedImage if topic.rstrip("/").endswith("compressed") else Image
            self._subs.append(self.create_subscription(
                msg_type, topic, lambda msg, i=index, t=topic: self._on_image(i, t, msg),
                qos_profile_sensor_data))
        if self.p.state_topic:  # an end-effector (or any) state vector instead of joint states
            self._subs.append(self.create_subscription(
                Float64MultiArray, self.p.state_topic, self._on_state_vector, qos_profile_sensor_data))
        else:
            self._subs.append(self.create_subscription(
                JointState, self.p.joint_state_topic, self._on_joints, qos_profile_sensor_data))

    def _refuse(self, source: str, kind: str, why: str) -> None:
        self.health.reject(kind, why, source=source)
        now = time.monotonic()  # at most one line per source every LOG_EVERY_S (rclpy's throttle is per call site:
        if now - self._logged_refusal.get(source, -LOG_EVERY_S) >= LOG_EVERY_S:  # one topic would hide the rest)
            self._logged_refusal[source] = now
            self.get_logger().warning(self.health.last_rejection)

    def _check_stamp(self, source: str, stamp_ns: int, now: int | None = None) -> bool:
        """now: when the message arrived (default: now); a frame's decode time is not its sender's lateness."""
        now = self.get_clock().now().nanoseconds if now is None else now
        if stamp_ns <= 0:  # (the age of such a stamp is the time since 1970: say what is wrong instead)
            self._refuse(source, "stamp_unset", "header.stamp is zero (not set by the sender)" if stamp_ns == 0 else
                         f"header.stamp is before 1970 ({stamp_ns / 1e9:.3f} s)")
            return False
        ahead = stamp_ns - now
        if ahead > self._future_limit_ns:  # a stamp from a clock ahead of ours: kept, it would lock out the
            # correctly stamped messages after it (stamps may not go back) and pass any age limit
            self._refuse(source, "stamp_future", f"stamp is {ahead / 1e6:.1f} ms ahead of the node's clock "
                                                 f"(limit {self._future_limit_ns / 1e6:g} ms): clocks disagree")
            return False
        if self._age_limit_ns is not None and -ahead > self._age_limit_ns:  # older than the age limit already:
            # an observation with it would be refused as stale anyway; refused here, where the topic is known
            started = self._started_ns
            when = "stamped before the node started" if started is not None and stamp_ns < started else \
                "late, or the sender's clock is behind"
            self._refuse(source, "stamp_old", f"stamp is {-ahead / 1e6:.1f} ms behind the node's clock, more than "
                                              f"max_observation_age_ms = {self._age_limit_ns / 1e6:g} ({when})")
            return False
        last = self._last_stamp.get(source)
        tick = self._last_tick_ns
        if last is not None and stamp_ns < last and tick is not None and now < tick - CLOCK_JUMP_NS:
            last = None  # the node's own clock went back since its last tick: a reset (the next tick resets
            # the runtime's clocks), not a message out of order. (A message stamped on the new clock that
            # arrives before the node's /clock moves back is still refused: the node cannot tell it apart.)
        if last is not None and stamp_ns < last:
            self._refuse(source, "stamp_backwards", f"stamp went back by {(last - stamp_ns) / 1e6:.1f} ms")
            return False
        self._last_stamp[source] = stamp_ns
        return True

    def _on_image(self, index: int, topic: str, msg):
        """The stamp is checked on arrival; decoding and fitting are the FrameFitter's."""
        stamp = conversions.stamp_to_ns(msg.header.stamp)
        warning = setup_checks.grey_camera_warning(topic, getattr(msg, "encoding", ""))
        if warning and topic not in self._grey_topics:  # (said once per camera and configuration)
            self._grey_topics.add(topic)
            self.health.setup_warnings = self.health.setup_warnings + [warning]
            self.get_logger().warning(warning)
        with self._sensor_lock:
            if self._check_stamp(topic, stamp):
                self._frames.submit(index, topic, msg, stamp)

    def _fit_frame(self, msg):
        """Any size up to conversions.MAX_PIXELS (checked before decoding, from a compressed header), fitted to
        the contract's frame size by the letterbox the replay uses too (the model's resize-with-pad); None while
        unconfigured. Runs in the FrameFitter's thread."""
        shape = self._frame_shape
        if shape is None:
            return None
        rgb = (conversions.compressed_to_rgb(msg) if isinstance(msg, CompressedImage) else
               conversions.image_to_rgb(msg))
        return letterbox(rgb, *shape[:2], self._frame_pad)

    def _store_frame(self, index: int, rgb, stamp: int) -> None:
        if stamp >= self._images.get(index, (None, -1))[1]:  # (sensor lock held)
            self._images[index] = (rgb, stamp)
            self._dirty = True

    @property
    def _state_source(self) -> str:
        return self.p.state_topic or self.p.joint_state_topic

    def _on_joints(self, msg: JointState):
        try:
            positions = conversions.joint_positions(msg, self.p.joint_names)
        except conversions.ConversionError as exc:
            self._refuse(self._state_source, "joint_state", str(exc))
            return
        self._store_state(positions, conversions.stamp_to_ns(msg.header.stamp))

    def _on_state_vector(self, msg: Float64MultiArray):
        """A state vector has no header: it is stamped on arrival with the node's clock."""
        try:
            values = conversions.state_vector(msg, self._state_dim)
        except conversions.ConversionError as exc:
            self._refuse(self._state_source, "state_vector", str(exc))
            return
        self._store_state(values, self.get_clock().now().nanoseconds)

    def _store_state(self, values: np.ndarray, stamp: int) -> None:
        with self._sensor_lock:
            if self._check_stamp(self._state_source, stamp):
                self._joints = (values, stamp)
                self._dirty = True

    def _on_set_parameters(self, parameters) -> SetParametersResult:
        """Unconfigured: any change (read at the next configure). Configured: `prompt` is applied at once (and
        refused with the runtime's reason); the others are read at configure only, so a change is refused
        rather than accepted and ignored."""
        if self.runtime is None:
            for p in parameters:  # (a value of the declared type: rclpy refuses any other before this callback)
                self._parameter_errors.pop(p.name, None)
            return SetParametersResult(successful=True)
        for p in parameters:  # (parameters of rclpy's own, e.g. use_sim_time, are live: let them through)
            if p.name != "prompt" and p.name in params.PARAMETERS:
                return SetParametersResult(successful=False, reason=(
                    f"{p.name}: read at configure; deactivate, clean up and configure again to change it"))
        for p in parameters:
            if self._prompt_echo or p.name != "prompt":
                continue
            try:
                with self.runtime_lock:
                    if self.runtime is not None:
                        self.runtime.set_prompt(p.value)
            except Exception as exc:  # InputError: empty, too long for the model's tokens, ...
                why = str(exc)
                return SetParametersResult(successful=False, reason=why if why.startswith("prompt") else
                                           f"prompt: {why}")
        return SetParametersResult(successful=True)

    def _apply_descriptor(self, parameter, descriptor=None, check_read_only=True):
        """rclpy's, with a wrong type said in words (its own reason gives type codes: expected '3' got '4')."""
        result = super()._apply_descriptor(parameter, descriptor, check_read_only)
        if not result.successful and result.reason.startswith("Wrong parameter type"):
            declared = (descriptor or self.describe_parameter(parameter.name)).type
            result.reason = params.type_error_reason(parameter.name, parameter.value, declared)
        return result

    def _on_prompt_bytes(self, cdr: bytes):
        try:
            self._on_prompt(String(data=conversions.prompt_text(cdr)))
        except conversions.ConversionError as exc:
            self.health.reject("prompt", str(exc), source=self.resolve_topic_name("~/prompt"))
            self.get_logger().warning(self.health.last_rejection)

    def _on_prompt(self, msg: String):
        with self.runtime_lock:
            if self.runtime is None:  # kept for the next configure, which checks it against the model
                if not msg.data.strip():
                    self.health.reject("prompt", "prompt: empty", source=self.resolve_topic_name("~/prompt"))
                    self.get_logger().warning(self.health.last_rejection)
                    return
                self.set_parameters([rclpy.parameter.Parameter("prompt", value=msg.data)])
                return
            try:
                self.runtime.set_prompt(msg.data)
            except Exception as exc:
                self.health.reject("prompt", str(exc), source=self.resolve_topic_name("~/prompt"))
                self.get_logger().warning(self.health.last_rejection)
                return
        self.follow_prompt(msg.data)

    def follow_prompt(self, prompt: str | None) -> None:
        """The `prompt` parameter follows the runtime's task (from ~/prompt, or a capsule restore that brought
        another task back), so that a cleanup and configure keep the task the robot was last running."""
        if not prompt or prompt == self.get_parameter("prompt").value:
            return
        self._prompt_echo = True
        try:
            self.set_parameters([rclpy.parameter.Parameter("prompt", value=prompt)])
        finally:
            self._prompt_echo = False

    def _missing_inputs(self) -> list[str]:
        """The topics that have not delivered a first message yet."""
        with self._sensor_lock:
            missing = [t for i, t in enumerate(self.p.camera_topics) if i not in self._images]
            return missing + ([self._state_source] if self._joints is None else [])

    def _oldest_input(self, now_ns: int) -> str:
        """' (oldest input: TOPIC, stamped N ms ago)' of the stored sensor messages, for a stale message."""
        with self._sensor_lock:
            parts = [(stamp, self.p.camera_topics[i]) for i, (_, stamp) in self._images.items()]
            if self._joints is not None:
                parts.append((self._joints[1], self._state_source))
        if not parts:
            return ""
        stamp, topic = min(parts)
        if self._age_limit_ns is not None and now_ns - stamp <= self._age_limit_ns:
            return ""  # (the sensors are fresh: the age is a buffer's, e.g. a prefix restored from a capsule)
        return f" (oldest input: {topic}, stamped {(now_ns - stamp) / 1e6:.0f} ms ago)"

    def _latest_observation(self):
        """The newest complete observation not yet fed to the runtime, or None."""
        with self._sensor_lock:
            if not self._dirty or self._joints is None or len(self._images) < len(self.p.camera_topics):
                return None
            self._dirty = False
            images = [self._images[i][0] for i in range(len(self.p.camera_topics))]
            # The observation is as old as its oldest part.
            stamp = min([self._images[i][1] for i in range(len(images))] + [self._joints[1]])
            return images, self._joints[0], stamp

    # ----------------------------------------------------------------- inference
    def _wake_worker(self):
        """A stage timer fired: wake the inference thread. A wake while it still computes a tick is an overrun
        (two stage timers that fire together while it waits are one wake: the tick runs every due stage)."""
        with self._wake:
            if self._ticking:
                self.health.overruns += 1
            self._wake_pending = True
            self._wake.notify()

    def _inference_loop(self):
        while True:
            with self._wake:
                while not self._wake_pending and not self._worker_stop:
                    self._wake.wait()
                if self._worker_stop or not self.context.ok():  # (the context shut down: SIGTERM)
                    return
                self._wake_pending = False
                self._ticking = True
            try:
                self._tick()
            finally:
                with self._wake:
                    self._ticking = False

    def _tick(self):
        with self.runtime_lock:  # (a capsule service or a prompt may hold it: the clock is read after)
            now_ns = self.get_clock().now().nanoseconds
            if self.runtime is None:
                return
            if self._last_tick_ns is not None and now_ns < self._last_tick_ns - CLOCK_JUMP_NS:
                self._clock_jumped_back(now_ns)
            self._last_tick_ns = now_ns
            observation = self._latest_observation()
            if observation is not None and observation[2] >= self._fed_stamp:
                images, state, stamp = observation
                try:
                    self.runtime.set_observation(images=images, state=state, stamp_ns=stamp)
                    self._fed_stamp = stamp
                    self._fresh_since_reset = True
                except Exception as exc:  # InputError and friends: reject, keep the last good one
                    self._refuse("observation", "observation", refusal_reason(exc, self.p, len(state)))
            if not self.runtime.has_observation():
                missing = self._missing_inputs()
                self.health.stale_reason = ("waiting for a first complete observation: nothing accepted yet on "
                                            + ", ".join(missing) if missing else
                                            "waiting for a first observation the runtime accepts")
                return
            if not self._fresh_since_reset:
                self.health.stale_reason = "the clock jumped back: waiting for observations stamped on the new clock"
                return
            try:  # publish as soon as the actions exist, before the deferred stages are launched
                result = self.runtime.step(now_ns, on_actions=self._publish_safely)
            except Exception as exc:
                self.health.last_error = f"step failed: {exc}"
                self.get_logger().error(self.health.last_error, throttle_duration_sec=2.0)
                return
        if self._worker_stop:  # stopping: nothing more to report
            return
        failed = [f"{stage} {why}" for stage, why in result.skipped.items() if why.startswith("failed")]
        if self._publish_error:
            failed.append(self._publish_error)
            self._publish_error = ""
        self.health.last_error = "; ".join(failed)  # e.g. a deferred observe whose host part failed
        if failed:
            self.get_logger().error(self.health.last_error, throttle_duration_sec=2.0)
        for stage, latency in result.completed_stage_ms().items():  # deferred stages: when they completed
            self.health.stages[stage].add(latency)
        if result.actions is None:
            if self.runtime.scheduler.output_stage in result.skipped:  # due, but refused (stale input)
                self.health.stale_reason = result.reason + self._oldest_input(now_ns)
                self.get_logger().warning(f"no actions: {self.health.stale_reason}", throttle_duration_sec=2.0)

    def _clock_jumped_back(self, now_ns: int) -> None:
        """The node's clock went back (a simulation reset under use_sim_time): the runtime's rate clocks and
        stamps start again, sensor messages stamped on the old clock are dropped, and no decision is made
        until an observation stamped on the new one is fed (runtime lock held)."""
        back_ms = (self._last_tick_ns - now_ns) / 1e6
        self.runtime.reset_clock()
        self._forget_sensors_after(now_ns + RESET_SKEW_NS)
        self._fed_stamp = -1
        self._fresh_since_reset = False
        self._started_ns = None  # (a stamp before the reset is not one from before the node started)
        self.health.clock_resets += 1
        self.get_logger().warning(f"the clock jumped back by {back_ms:.1f} ms (a simulation reset?): rate clocks "
                                  "and stamps start again; waiting for observations on the new clock")

    def rewound(self, watermark_ns: int | None) -> None:
        """After a restore with rewind_time (runtime lock held): the node's own stamp checks rewind with the
        runtime's, so observations stamped after the snapshot (re-sent by a replay or a reset simulation) are
        accepted again; held sensor messages newer than the snapshot's watermark are dropped."""
        w = -1 if watermark_ns is None else int(watermark_ns)
        self._forget_sensors_after(w)
        with self._sensor_lock:
            self._dirty = bool(self._images) or self._joints is not None
        self._fed_stamp = w

    def _forget_sensors_after(self, limit_ns: int) -> None:
        """Drop every sensor message held, being fitted or remembered as a topic's last stamp that is stamped
        after limit_ns (a clock reset, a rewind)."""
        with self._sensor_lock:
            self._images = {i: v for i, v in self._images.items() if v[1] <= limit_ns}
            self._frames.drop(keep=lambda stamp: stamp <= limit_ns)
            if self._joints is not None and self._joints[1] > limit_ns:
                self._joints = None
            self._last_stamp = {k: v for k, v in self._last_stamp.items() if v <= limit_ns}

    def _publish_safely(self, result):
        """on_actions: publish; a failure is reported as such (the step itself went on and committed)."""
        try:
            self._publish(result)
        except Exception as exc:  # noqa: BLE001 (reported in diagnostics and the log by _tick)
            if not self.context.ok():  # the process is stopping (SIGTERM shut the context down): the end,
                self._worker_stop = True  # quietly (a log line now would fail to reach rosout too)
                return
            self._publish_error = f"publishing the chunk failed: {type(exc).__name__}: {exc}"

    def _publish(self, result):
        # (a NaN or infinite chunk raises here: reported by _tick as a failed publish, nothing is sent)
        actions = conversions.action_chunk(result.actions)  # (the contract's width: checkpoint or parameters)
        self.health.stale_reason = ""
        msg = action_chunk_message(result, actions, self._action_names, self.p.action_dt, self.get_clock().now())
        self._chunk_pub.publish(msg)
        self.health.chunks_published += 1
        traj = trajectory_message(msg, actions) if self._traj_pub is not None else None
        if traj is not None:
            self._traj_pub.publish(traj)

    # ----------------------------------------------------------------- diagnostics
    def _publish_diagnostics(self):
        # named by the node's fully qualified name: nodes of one name in two namespaces stay apart
        runtime = self.runtime
        now = self.get_clock().now()
        self.health.clock_stalled = self._clock_watch.update(now.nanoseconds, self.get_parameter("use_sim_time").value)
        self._diag_pub.publish(self.health.message(f"{self.get_fully_qualified_name()}: policy",
                                                   runtime.describe() if runtime is not None else "unconfigured",
                                                   now.to_msg()))


def main(args=None):
    # Ctrl-C only asks the spin loop below to end, so that the inference thread is stopped while the context is
    # still valid (rclpy's SIGINT handler shuts the context down at once, under a chunk being published). Not a
    # KeyboardInterrupt: raised inside the executor's callback machinery it can be swallowed there, and a node
    # with no sensor input then ignored Ctrl-C until launch escalated to SIGTERM after 5 s.
    # rclpy handles SIGTERM: a publish on the context it shut down ends the inference thread quietly.
    # (a process started in the background by a non-interactive shell inherits SIGINT ignored: take it back,
    # so that Ctrl-C and `kill -INT` stop the node wherever it was started)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.SIGTERM)
    node = PolicyNode()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        while not stop.is_set() and node.context.ok() and not node.finalized:
            executor.spin_once(timeout_sec=STOP_POLL_S)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except _rclpy.RCLError:  # SIGTERM shut the context down between two of the executor's waits: the end
        if node.context.ok():  # (a failure of a live context is a real error)
            raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        node._stop_timers()  # the inference thread must not publish through a node being destroyed
        node.capsules.shutdown()  # (a capsule call in progress is not waited for; queued ones are dropped)
        executor.shutdown()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()


if __name__ == "__main__":
    main()
