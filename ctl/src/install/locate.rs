//! Where each runtime reads what `install` edits, when the command line does not say: the
//! config file of the containerd that runs (its `--config`/`-c`), and the hooks directories of
//! podman's `containers.conf` (`[engine] hooks_dir`). The decisions are pure functions of the
//! processes' arguments and the files' texts; reading `/proc` and the files is the rest.

use std::path::{Path, PathBuf};

use super::{InstallError, DEFAULT_CONTAINERD_CONFIG, DEFAULT_HOOKS_DIR};

/// The config file a containerd started with `args` (its arguments after the program) reads,
/// relative paths taken from `cwd`: the last `--config`/`-c` (`--config=PATH`, `-c=PATH` too),
/// else containerd's default.
pub fn containerd_config_of(args: &[String], cwd: &Path) -> PathBuf {
    let mut config = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let value = match arg.as_str() {
            "--config" | "-c" => args.next().cloned(),
            other => ["--config=", "-c="]
                .iter()
                .find_map(|flag| other.strip_prefix(flag))
                .map(str::to_string),
        };
        if value.is_some() {
            config = value;
        }
    }
    match config {
        Some(path) => cwd.join(path),
        None => PathBuf::from(DEFAULT_CONTAINERD_CONFIG),
    }
}

/// The one config the running containerds read (`found`, one per process), containerd's default
/// when none runs; several different ones are refused, since install cannot tell which to edit.
pub fn choose_containerd_config(mut found: Vec<PathBuf>) -> Result<PathBuf, InstallError> {
    found.sort();
    found.dedup();
    match found.len() {
        0 => Ok(PathBuf::from(DEFAULT_CONTAINERD_CONFIG)),
        1 => Ok(found.remove(0)),
        _ => Err(InstallError::Locate(format!(
            "containerds run here with different configs ({}): name the one to edit with --config PATH; nothing changed",
            found
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Whether a process whose `/proc/PID/status` is `status` and whose mount namespace is `mnt`
/// (the `/proc/PID/ns/mnt` link) may say which file is containerd's config here: one running as
/// root (every uid 0) in this command's mount namespace `own_mnt`, where its paths mean what
/// they mean here. Anything else named `containerd` (a tenant's process in a container, a
/// user's) is not asked: its `--config` could name any file for install to write.
pub fn trusted_containerd(status: &str, mnt: &str, own_mnt: &str) -> bool {
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|uids| {
            let uids: Vec<&str> = uids.split_whitespace().collect();
            uids.len() == 4 && uids.iter().all(|u| *u == "0")
        });
    root && !mnt.is_empty() && mnt == own_mnt
}

/// The config of the containerd running on this machine (processes named `containerd`, as
/// root, in this mount namespace: [`trusted_containerd`]).
pub fn running_containerd_config() -> Result<PathBuf, InstallError> {
    let mut found = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return choose_containerd_config(found);
    };
    let mount_namespace = |dir: &Path| {
        std::fs::read_link(dir.join("ns/mnt"))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let own_mnt = mount_namespace(Path::new("/proc/self"));
    for entry in procs.flatten() {
        let dir = entry.path();
        if entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
            .is_none()
        {
            continue;
        }
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() != "containerd" {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        if !trusted_containerd(&status, &mount_namespace(&dir), &own_mnt) {
            continue;
        }
        let (Ok(cmdline), Ok(cwd)) = (
            std::fs::read(dir.join("cmdline")),
            std::fs::read_link(dir.join("cwd")),
        ) else {
            continue; // gone meanwhile
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .skip(1)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        found.push(containerd_config_of(&args, &cwd));
    }
    choose_containerd_config(found)
}

/// The `containers.conf` files podman reads as root, in order (a later one's setting wins):
/// `$CONTAINERS_CONF` alone when it is set; else the distribution's, the machine's, and the
/// machine's drop-ins in name order.
pub fn containers_conf_files(
    env: Option<&std::ffi::OsStr>,
    etc: &Path,
    usr: &Path,
) -> Vec<PathBuf> {
    if let Some(file) = env.filter(|f| !f.is_empty()) {
        return vec![PathBuf::from(file)];
    }
    let mut files = vec![
        usr.join("containers/containers.conf"),
        etc.join("containers/containers.conf"),
    ];
    let mut drop_ins: Vec<PathBuf> = std::fs::read_dir(etc.join("containers/containers.conf.d"))
        .map(|dir| {
            dir.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "conf"))
                .collect()
        })
        .unwrap_or_default();
    drop_ins.sort();
    files.extend(drop_ins);
    files
}

/// The hooks directory `install podman` writes to: the first of `[engine] hooks_dir` as the last
/// of `confs` (file name, text) that sets it says, else podman's default. A file that does not
/// parse is named with its line and column.
pub fn podman_hooks_dir(confs: &[(String, String)]) -> Result<PathBuf, InstallError> {
    let mut dirs: Option<Vec<PathBuf>> = None;
    for (name, text) in confs {
        let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            let (line, column) = super::position(text, e.span().map_or(0, |s| s.start));
            InstallError::Locate(format!(
                "{name}: line {line}, column {column}: {}; nothing changed",
                super::one_line(e.message())
            ))
        })?;
        let Some(value) = table.get("engine").and_then(|e| e.get("hooks_dir")) else {
            continue;
        };
        let list = value
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_str().map(PathBuf::from)).collect())
            .ok_or_else(|| {
                InstallError::Locate(format!(
                    "{name}: [engine] hooks_dir is not a list of directories; nothing changed"
                ))
            })?;
        dirs = Some(list);
    }
    match dirs {
        None => Ok(PathBuf::from(DEFAULT_HOOKS_DIR)),
        Some(dirs) => dirs.into_iter().next().ok_or_else(|| {
            InstallError::Locate(
                "podman's containers.conf sets hooks_dir = [], so podman reads no hooks: name a directory with --hooks-dir DIR and add it there; nothing changed".into(),
            )
        }),
    }
}

/// The hooks directory of the `containers.conf` files podman reads on this machine.
pub fn podman_hooks_dir_here() -> Result<PathBuf, InstallError> {
    let env = std::env::var_os("CONTAINERS_CONF");
    let mut confs = Vec::new();
    for file in containers_conf_files(env.as_deref(), Path::new("/etc"), Path::new("/usr/share")) {
        if let Some(text) = super::read_text(&file)? {
            confs.push((file.display().to_string(), text));
        }
    }
    podman_hooks_dir(&confs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_containerd_reads_the_config_its_arguments_name() {
        let cwd = Path::new("/var/lib/x");
        let default = PathBuf::from(DEFAULT_CONTAINERD_CONFIG);
        assert_eq!(containerd_config_of(&args(&[]), cwd), default);
        assert_eq!(
            containerd_config_of(&args(&["--log-level", "debug"]), cwd),
            default
        );
        for given in [
            &["--config", "/etc/k/c.toml"][..],
            &["-c", "/etc/k/c.toml"],
            &["--config=/etc/k/c.toml"],
            &["-c=/etc/k/c.toml"],
            &["-c", "/old.toml", "--config", "/etc/k/c.toml"],
        ] {
            assert_eq!(
                containerd_config_of(&args(given), cwd),
                PathBuf::from("/etc/k/c.toml"),
                "{given:?}"
            );
        }
        assert_eq!(
            containerd_config_of(&args(&["-c", "c.toml"]), cwd),
            PathBuf::from("/var/lib/x/c.toml")
        );
        // A flag with no value left is no config.
        assert_eq!(containerd_config_of(&args(&["--config"]), cwd), default);
    }

    #[test]
    fn only_roots_containerd_in_this_mount_namespace_is_asked() {
        let status = |uids: &str| {
            format!("Name:\tcontainerd\nUmask:\t0022\nUid:\t{uids}\nGid:\t0\t0\t0\t0\n")
        };
        let ours = "mnt:[4026531841]";
        assert!(trusted_containerd(&status("0\t0\t0\t0"), ours, ours));
        // A user's process, even one that became root only in part.
        for uids in [
            "65534\t65534\t65534\t65534",
            "1000\t0\t0\t0",
            "0\t0\t0\t1000",
            "0\t0",
        ] {
            assert!(!trusted_containerd(&status(uids), ours, ours), "{uids}");
        }
        // A container's (another mount namespace: its paths are not ours), or one unknown.
        assert!(!trusted_containerd(
            &status("0\t0\t0\t0"),
            "mnt:[4026532200]",
            ours
        ));
        assert!(!trusted_containerd(&status("0\t0\t0\t0"), "", ""));
        assert!(!trusted_containerd("", ours, ours));
    }

    #[test]
    fn one_config_among_the_running_containerds_is_chosen_several_are_refused() {
        assert_eq!(
            choose_containerd_config(vec![]).unwrap(),
            PathBuf::from(DEFAULT_CONTAINERD_CONFIG)
        );
        let a = PathBuf::from("/a.toml");
        let b = PathBuf::from("/b.toml");
        assert_eq!(
            choose_containerd_config(vec![a.clone(), a.clone()]).unwrap(),
            a
        );
        let e = choose_containerd_config(vec![b, a])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "containerds run here with different configs (/a.toml, /b.toml): name the one to edit with --config PATH; nothing changed");
    }

    #[test]
    fn podman_hooks_go_to_the_first_directory_of_the_last_setting() {
        let conf = |name: &str, text: &str| (name.to_string(), text.to_string());
        assert_eq!(
            podman_hooks_dir(&[]).unwrap(),
            PathBuf::from(DEFAULT_HOOKS_DIR)
        );
        let usr = conf("usr", "[engine]\nhooks_dir = [\"/usr/h\", \"/etc/h\"]\n");
        let etc = conf("etc", "[engine]\nhooks_dir = [\"/opt/h\"]\n");
        let silent = conf("drop-in", "[containers]\nlog_size_max = -1\n");
        assert_eq!(
            podman_hooks_dir(&[usr.clone(), silent.clone()]).unwrap(),
            PathBuf::from("/usr/h")
        );
        assert_eq!(
            podman_hooks_dir(&[usr, etc, silent]).unwrap(),
            PathBuf::from("/opt/h")
        );
        let e = podman_hooks_dir(&[conf("c.conf", "[engine]\nhooks_dir = []\n")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("hooks_dir = []"), "{e}");
        let e = podman_hooks_dir(&[conf("c.conf", "[engine]\nhooks_dir = \"/x\"\n")])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.conf: [engine] hooks_dir is not a list of directories; nothing changed"
        );
        let e = podman_hooks_dir(&[conf("c.conf", "[engine]\nhooks_dir = [\"/a\" \"/b\"]\n")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("c.conf: line 2, column "), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(e.ends_with("; nothing changed"), "{e}");
    }

    #[test]
    fn containers_conf_alone_replaces_the_machines_files() {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        std::fs::create_dir_all(etc.join("containers/containers.conf.d")).unwrap();
        for name in ["b.conf", "a.conf", "notes.txt"] {
            std::fs::write(etc.join("containers/containers.conf.d").join(name), "").unwrap();
        }
        let usr = dir.path().join("usr");
        assert_eq!(
            containers_conf_files(None, &etc, &usr),
            [
                usr.join("containers/containers.conf"),
                etc.join("containers/containers.conf"),
                etc.join("containers/containers.conf.d/a.conf"),
                etc.join("containers/containers.conf.d/b.conf"),
            ]
        );
        assert_eq!(
            containers_conf_files(Some("/tmp/mine.conf".as_ref()), &etc, &usr),
            [PathBuf::from("/tmp/mine.conf")]
        );
    }
}
