//! podman's hooks: the three `hooks.d` files of `config/hooks.d` (built into the binary), each
//! calling the `gpuplex-hook` beside `gpuplexctl` (or `--hook`), in podman's hooks directory.
//!
//! A file is written exactly as shipped but for the hook's path, as `make install` writes its
//! copies under `$(PREFIX)/share/gpuplex/hooks.d`. So uninstall knows a file as gpuplex's when
//! it is exactly that for the path it names, whoever copied it there, and leaves any other alone.

use std::path::{Path, PathBuf};

use super::{read_text, Change, InstallError, Plan};

/// The path the shipped files name; replaced by the hook's.
pub const SHIPPED_HOOK: &str = "/usr/bin/gpuplex-hook";

/// The shipped files, by name, in the order podman runs them.
pub const FILES: [(&str, &str); 3] = [
    (
        "gpuplex-precreate.json",
        include_str!("../../../config/hooks.d/gpuplex-precreate.json"),
    ),
    (
        "gpuplex-createRuntime.json",
        include_str!("../../../config/hooks.d/gpuplex-createRuntime.json"),
    ),
    (
        "gpuplex-poststop.json",
        include_str!("../../../config/hooks.d/gpuplex-poststop.json"),
    ),
];

/// The line every podman outcome ends with.
pub const NO_RESTART: &str = "podman needs no restart: its next container reads them";

/// `shipped` calling `hook` instead of [`SHIPPED_HOOK`]; `None` when `hook` is not UTF-8.
pub fn render(shipped: &str, hook: &Path) -> Option<String> {
    let hook = serde_json::to_string(hook.to_str()?).ok()?;
    Some(shipped.replace(&format!("\"{SHIPPED_HOOK}\""), &hook))
}

/// Whether `text` is the shipped file `shipped` calling whatever hook it names.
pub fn is_ours(text: &str, shipped: &str) -> bool {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return false;
    };
    let Some(hook) = value["hook"]["path"].as_str() else {
        return false;
    };
    render(shipped, Path::new(hook)).is_some_and(|ours| ours == text)
}

/// The hook the files call: `given` (`--hook`, an absolute path), else the `gpuplex-hook`
/// beside `exe` (`gpuplexctl` itself, as `make install` and the DaemonSet install them); it
/// must be there.
pub fn resolve_hook(given: Option<&Path>, exe: Option<PathBuf>) -> Result<PathBuf, InstallError> {
    let hook = match given {
        Some(path) => path.to_path_buf(),
        None => match exe.as_deref().and_then(Path::parent) {
            Some(dir) => dir.join("gpuplex-hook"),
            None => {
                return Err(InstallError::Hook(
                    "cannot tell where gpuplexctl is, so where gpuplex-hook is: name it with --hook PATH; nothing changed".into(),
                ))
            }
        },
    };
    if hook.to_str().is_none() {
        return Err(InstallError::Hook(format!(
            "{}: podman's hooks.d files need the hook's path as UTF-8 text; nothing changed",
            hook.display()
        )));
    }
    match std::fs::metadata(&hook) {
        Ok(meta) if meta.is_file() => Ok(hook),
        _ => Err(InstallError::Hook(format!(
            "there is no gpuplex-hook at {}: install it (make install), or name it with --hook PATH; nothing changed",
            hook.display()
        ))),
    }
}

/// The plan of `gpuplexctl install podman`: the files calling `hook` in `dir`, written where
/// missing or different.
pub fn plan_install(dir: &Path, hook: &Path) -> Result<Plan, InstallError> {
    let shown = dir.display();
    let mut changes = Vec::new();
    let mut written = Vec::new();
    for (name, shipped) in FILES {
        let ours = render(shipped, hook).ok_or_else(|| {
            InstallError::Hook(format!("{}: not UTF-8; nothing changed", hook.display()))
        })?;
        let path = dir.join(name);
        let before = read_text(&path)?;
        if before.as_deref() == Some(ours.as_str()) {
            continue;
        }
        written.push(format!(
            "{name} ({})",
            if before.is_some() { "updated" } else { "new" }
        ));
        changes.push(Change::Write {
            shown: path.display().to_string(),
            path,
            before,
            after: ours,
        });
    }
    if changes.is_empty() {
        return Ok(Plan::nothing(format!(
            "podman's gpuplex hooks in {shown} are installed already, calling {}; nothing changed",
            hook.display()
        )));
    }
    let what = format!(
        "{} in {shown}, calling {}",
        written.join(", "),
        hook.display()
    );
    Ok(Plan {
        changes,
        done: format!("wrote {what}; {NO_RESTART}"),
        would: format!("write {what}"),
        ok: true,
    })
}

/// The plan of `gpuplexctl uninstall podman`: every file of gpuplex's in `dir` that is still
/// what install writes removed; one that is not is left, and the line says so (exit 1).
pub fn plan_uninstall(dir: &Path) -> Result<Plan, InstallError> {
    let shown = dir.display();
    let mut changes = Vec::new();
    let mut removed = Vec::new();
    let mut left = Vec::new();
    for (name, shipped) in FILES {
        let path = dir.join(name);
        let text = match read_text(&path) {
            Ok(Some(text)) => text,
            Ok(None) => continue,
            Err(InstallError::NotText { .. }) => {
                left.push(name);
                continue;
            }
            Err(e) => return Err(e),
        };
        if is_ours(&text, shipped) {
            removed.push(name);
            changes.push(Change::Remove {
                shown: path.display().to_string(),
                path,
                before: text,
            });
        } else {
            left.push(name);
        }
    }
    let left_line = (!left.is_empty()).then(|| {
        format!(
            "left {} in {shown}: not what gpuplexctl install writes (changed since?); remove it yourself",
            left.join(", ")
        )
    });
    if changes.is_empty() {
        return Ok(match left_line {
            None => Plan::nothing(format!(
                "podman's gpuplex hooks are not in {shown}; nothing changed"
            )),
            Some(line) => Plan {
                changes,
                done: format!("{line}; nothing changed"),
                would: line,
                ok: false,
            },
        });
    }
    let what = format!("{} from {shown}", removed.join(", "));
    Ok(match left_line {
        None => Plan {
            changes,
            done: format!("removed {what}; {NO_RESTART}"),
            would: format!("remove {what}"),
            ok: true,
        },
        Some(line) => Plan {
            changes,
            done: format!("removed {what}, but {line}"),
            would: format!("remove {what}, but {line}"),
            ok: false,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOOK: &str = "/opt/gpuplex/bin/gpuplex-hook";

    #[test]
    fn the_shipped_files_name_the_shipped_hook_at_their_stage() {
        for (name, shipped) in FILES {
            let value: serde_json::Value = serde_json::from_str(shipped).unwrap();
            assert_eq!(value["hook"]["path"], SHIPPED_HOOK, "{name}");
            let stage = value["stages"][0].as_str().unwrap();
            assert_eq!(name, format!("gpuplex-{stage}.json"));
            assert_eq!(
                value["hook"]["args"],
                serde_json::json!(["gpuplex-hook", stage])
            );
            // The default path renders the file as shipped, byte for byte.
            assert_eq!(render(shipped, Path::new(SHIPPED_HOOK)).unwrap(), shipped);
            assert!(is_ours(shipped, shipped));
        }
    }

    #[test]
    fn a_file_is_ours_for_any_hook_path_and_not_once_changed() {
        let (_, shipped) = FILES[0];
        let ours = render(shipped, Path::new(HOOK)).unwrap();
        let value: serde_json::Value = serde_json::from_str(&ours).unwrap();
        assert_eq!(value["hook"]["path"], HOOK);
        assert!(is_ours(&ours, shipped));
        // A path needing escapes stays valid JSON and is still recognized.
        let odd = render(shipped, Path::new("/opt/a \"b\"/gpuplex-hook")).unwrap();
        let value: serde_json::Value = serde_json::from_str(&odd).unwrap();
        assert_eq!(value["hook"]["path"], "/opt/a \"b\"/gpuplex-hook");
        assert!(is_ours(&odd, shipped));
        assert!(!is_ours(
            &ours.replace("precreate\"]", "precreate\", \"-v\"]"),
            shipped
        ));
        assert!(!is_ours(&ours.replace(".*", "x"), shipped));
        assert!(!is_ours("not json", shipped));
        assert!(!is_ours(FILES[1].1, shipped));
    }

    fn hook_in(dir: &Path) -> PathBuf {
        let hook = dir.join("gpuplex-hook");
        std::fs::write(&hook, "#!/bin/sh\n").unwrap();
        hook
    }

    #[test]
    fn install_writes_missing_and_changed_files_then_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = dir.path().join("hooks.d");
        let hook = hook_in(dir.path());
        let plan = plan_install(&hooks, &hook).unwrap();
        assert_eq!(plan.changes.len(), 3);
        assert!(plan.done.starts_with("wrote gpuplex-precreate.json (new), gpuplex-createRuntime.json (new), gpuplex-poststop.json (new) in "), "{}", plan.done);
        assert!(plan.done.ends_with(NO_RESTART), "{}", plan.done);
        let diff = plan.diff();
        assert_eq!(diff.matches("--- /dev/null\n").count(), 3, "{diff}");
        plan.apply().unwrap();
        let again = plan_install(&hooks, &hook).unwrap();
        assert!(again.changes.is_empty());
        assert!(again.done.contains("installed already"), "{}", again.done);
        // An operator's change is put back.
        let path = hooks.join("gpuplex-poststop.json");
        std::fs::write(&path, "{}").unwrap();
        let plan = plan_install(&hooks, &hook).unwrap();
        assert_eq!(plan.changes.len(), 1);
        assert!(
            plan.done
                .starts_with("wrote gpuplex-poststop.json (updated)"),
            "{}",
            plan.done
        );
        plan.apply().unwrap();
        assert!(is_ours(
            &std::fs::read_to_string(&path).unwrap(),
            FILES[2].1
        ));
    }

    #[test]
    fn uninstall_removes_only_what_install_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let hooks = dir.path().join("hooks.d");
        let hook = hook_in(dir.path());
        plan_install(&hooks, &hook).unwrap().apply().unwrap();
        std::fs::write(hooks.join("other.json"), "{}").unwrap();
        let changed = hooks.join("gpuplex-createRuntime.json");
        let text = std::fs::read_to_string(&changed)
            .unwrap()
            .replace("createRuntime\"]", "createRuntime\", \"--debug\"]");
        std::fs::write(&changed, &text).unwrap();
        let plan = plan_uninstall(&hooks).unwrap();
        assert!(!plan.ok);
        assert_eq!(plan.changes.len(), 2);
        assert!(
            plan.done
                .starts_with("removed gpuplex-precreate.json, gpuplex-poststop.json from "),
            "{}",
            plan.done
        );
        let left = format!(
            "but left gpuplex-createRuntime.json in {}: not what gpuplexctl install writes (changed since?); remove it yourself",
            hooks.display()
        );
        assert!(plan.done.ends_with(&left), "{}", plan.done);
        plan.apply().unwrap();
        let mut names: Vec<_> = std::fs::read_dir(&hooks)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["gpuplex-createRuntime.json", "other.json"]);
        assert_eq!(std::fs::read_to_string(&changed).unwrap(), text);
        std::fs::remove_file(&changed).unwrap();
        let plan = plan_uninstall(&hooks).unwrap();
        assert!(plan.ok && plan.changes.is_empty());
        assert!(plan.done.contains("are not in"), "{}", plan.done);
    }

    #[test]
    fn the_hook_must_be_there() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("gpuplexctl");
        let err = resolve_hook(None, Some(exe.clone()))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "there is no gpuplex-hook at {}: install it (make install), or name it with --hook PATH; nothing changed",
                dir.path().join("gpuplex-hook").display()
            )
        );
        let hook = hook_in(dir.path());
        assert_eq!(resolve_hook(None, Some(exe)).unwrap(), hook);
        assert_eq!(resolve_hook(Some(&hook), None).unwrap(), hook);
        assert!(resolve_hook(None, None).is_err());
    }
}
