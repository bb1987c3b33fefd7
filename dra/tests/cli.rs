//! `gpuplex-dra`'s command line: usage, and one line for each reason it cannot start.

use std::process::Command;

fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpuplex-dra"));
    command
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("GPUPLEX_CONFIG");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn help_and_bad_arguments() {
    let (code, out, _) = run(&["--help"], &[]);
    assert_eq!(code, 0);
    assert!(out.starts_with("usage: gpuplex-dra"), "{out}");
    let (code, _, err) = run(&["--frobnicate"], &[]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "gpuplex-dra: invalid option '--frobnicate'; try --help"
    );
    let (code, _, err) = run(&["--poll", "0s"], &[]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "gpuplex-dra: --poll \"0s\": expected a duration from 1ms to 1h, like \"2s\"; try --help"
    );
    let (code, _, err) = run(&["--node"], &[]);
    assert_eq!(code, 2);
    assert!(
        err.starts_with("gpuplex-dra: ") && err.trim().ends_with("try --help"),
        "{err}"
    );
}

#[test]
fn each_reason_it_cannot_start_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpuplex.toml");
    std::fs::write(&config, "[service]\nsocket = \"relative.sock\"\n").unwrap();
    let plugin = dir.path().join("plugin.toml");
    std::fs::write(&plugin, "[kubernetes]\nplugin = \"nvidia\"\n").unwrap();
    /// Arguments, environment, what the line names.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--config", "/nonexistent/gpuplex.toml"],
            vec![],
            "/nonexistent/gpuplex.toml",
        ),
        (
            vec!["--config", config.to_str().unwrap(), "--node", "n"],
            vec![],
            "socket",
        ),
        (
            vec!["--config", plugin.to_str().unwrap(), "--node", "n"],
            vec![],
            "kubernetes.plugin",
        ),
        (
            vec![],
            vec![
                ("GPUPLEX_CONFIG", "/nonexistent/none.toml"),
                ("NODE_NAME", "n"),
            ],
            "none.toml",
        ),
    ];
    for (args, env, expected) in cases {
        let (code, _, err) = run(&args, &env);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(
            err.starts_with("gpuplex-dra: ") && err.contains(expected),
            "{args:?}: {err}"
        );
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    // An absent default configuration is every default; then the node name is missing.
    let (code, _, err) = run(&[], &[]);
    if std::path::Path::new("/etc/gpuplex/gpuplex.toml").exists() {
        eprintln!("SKIPPED part: /etc/gpuplex/gpuplex.toml exists on this machine");
        return;
    }
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no node name"), "{err}");
}
