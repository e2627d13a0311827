//! The process table, read from `/proc`: the ground truth of what hearthd
//! and its helpers left running.

use std::path::Path;

/// Every live pid with its command line (arguments split at NUL), zombies
/// included: callers filter on what they need.
pub fn command_lines() -> Vec<(u32, Vec<String>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|p| p.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, args))
        })
        .collect()
}

/// qemu-img processes whose command line names `path` (an argument that
/// starts with it).
pub fn converters_of(path: &Path) -> Vec<u32> {
    let want = path.to_string_lossy().into_owned();
    command_lines()
        .into_iter()
        .filter(|(_, args)| {
            args.first().is_some_and(|a| a.ends_with("qemu-img"))
                && args.iter().any(|a| a.starts_with(&want))
        })
        .map(|(pid, _)| pid)
        .collect()
}

/// Whether `pid` names a process that has not exited (a zombie has).
pub fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
}

/// Whether `pid` has exited and waits for its parent; true when it is gone.
pub fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// When a process started, in clock ticks since boot (`/proc/PID/stat`
/// field 22): with the pid, it names one process, even if the pid is reused.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    // Fields after the name start at field 3 (state).
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// Every thread of `pid` is traced (`TracerPid` in its status is not 0):
/// a tracer attached with `-p` stops each of them from here on.
pub fn all_threads_traced(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let mut any = false;
    tasks.flatten().all(|t| {
        any = true;
        std::fs::read_to_string(t.path().join("status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("TracerPid:"))
            .is_some_and(|v| v.trim() != "0")
    }) && any
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_has_a_start_time() {
        let me = std::process::id();
        assert!(is_alive(me));
        assert!(!is_zombie(me));
        assert!(start_ticks(me).is_some());
        assert!(command_lines().iter().any(|(pid, _)| *pid == me));
    }

    #[test]
    fn a_pid_that_is_not_there_is_not_alive() {
        // Above the kernel's pid_max limit (2^22).
        assert!(!is_alive(u32::MAX - 1));
        assert_eq!(start_ticks(u32::MAX - 1), None);
    }

    #[test]
    fn converters_of_a_path_nothing_reads_is_empty() {
        assert!(converters_of(Path::new("/nonexistent/hearth-test-support")).is_empty());
    }
}
