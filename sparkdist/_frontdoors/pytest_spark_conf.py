"""The conf of the pytest plugin's own SparkSession, as a pure function of its inputs.

The session is quiet (a log4j2 file that keeps Spark's start-up chatter off the terminal),
loopback only and small. The user's ``sparkdist_spark_conf`` goes over it key by key, except
keys that hold JVM flags: those are joined, ours first, so a user who passes
``spark.driver.extraJavaOptions`` keeps the quiet log file too, and a flag of theirs that sets
the same property (their own ``-Dlog4j2.configurationFile``) still wins, the JVM taking the
last one.

Non-goals: writing the log file, starting or reusing the session (``pytest_support``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping

QUIET_LOG4J2 = """\
# WARN at the root, as Spark's shell default is, or Spark says it is setting that default;
# the session lowers it to ERROR once started.
rootLogger.level = warn
logger.native.name = org.apache.hadoop.util.NativeCodeLoader
logger.native.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
"""

#: Keys whose value is a space-separated list of JVM flags: ours and the user's are joined.
JVM_FLAG_KEYS = frozenset({"spark.driver.extraJavaOptions"})


def session_conf(master: str, log_conf: str, user_conf: Mapping[str, str]) -> dict[str, str]:
    """The SparkSession conf for ``master``, logging through the log4j2 file ``log_conf``.

    Args:
        master: the session's master (``local-cluster[n,cores,MB]`` sizes the executors).
        log_conf: path of a log4j2 properties file holding ``QUIET_LOG4J2``.
        user_conf: the ini key ``sparkdist_spark_conf``, parsed; it wins over ours, but JVM
            flags (``JVM_FLAG_KEYS``) are added after ours instead of replacing them.
    """
    conf = {
        "spark.pyspark.python": sys.executable,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.executorEnv.SPARK_LOCAL_IP": "127.0.0.1",
        "spark.sql.shuffle.partitions": "2",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log_conf}",
    }
    cluster = re.fullmatch(r"local-cluster\[\s*\d+\s*,\s*\d+\s*,\s*(\d+)\s*\]", master)
    if cluster is not None:
        # Each worker of local-cluster[n,cores,MB] offers MB; an executor must fit in it.
        conf["spark.executor.memory"] = f"{int(cluster.group(1)) * 3 // 4}m"
    for key, value in user_conf.items():
        if key not in JVM_FLAG_KEYS:
            conf[key] = value
        elif value.strip():  # an empty value adds no flag and must not drop ours
            conf[key] = f"{conf[key]} {value.strip()}"
    return conf
