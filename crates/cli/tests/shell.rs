//! What the CLI gives a shell and a reader: completion scripts and the manual page.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed step is a failed test

mod support;

use support::*;

#[test]
fn bash_completes_warden_subcommands_and_flags() {
    let script = warden().args(["completions", "bash"]).output().unwrap();
    assert!(script.status.success());
    let dir = tempdir();
    let file = dir.path().join("warden.bash");
    std::fs::write(&file, &script.stdout).unwrap();
    // Load it into a real bash and ask it what `warden ru<TAB>` and `warden run --mem<TAB>` give.
    let ask = |line: &str| {
        let words: Vec<&str> = line.split(' ').collect();
        let program = format!(
            "source {}; COMP_WORDS=({}); COMP_CWORD={}; COMP_LINE='{line}'; COMP_POINT={}; _warden warden; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            file.display(),
            words.join(" "),
            words.len() - 1,
            line.len()
        );
        let out = std::process::Command::new("bash")
            .args(["-c", &program])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    };
    let subcommands = ask("warden ru");
    assert!(subcommands.lines().any(|l| l == "run"), "{subcommands}");
    let flags = ask("warden run --mem");
    assert!(flags.lines().any(|l| l == "--memory"), "{flags}");
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = warden().args(["completions", shell]).output().unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("approvals"),
            "{shell}"
        );
    }
    let bad = Ran::from(warden().args(["completions", "tcsh"]).output().unwrap());
    assert_eq!(bad.code, warden_protocol::exit::WARDEN_ERROR);
    assert!(bad.stderr.contains("possible values"), "{bad:?}");
}

#[test]
fn the_manual_page_covers_every_subcommand_with_its_options() {
    let out = warden().arg("man").output().unwrap();
    assert!(out.status.success());
    let page = String::from_utf8(out.stdout).unwrap();
    assert!(
        page.starts_with(".ie") || page.starts_with(".TH"),
        "{}",
        &page[..80]
    );
    assert!(page.contains(".TH warden 1"));
    for sub in [
        "RUN",
        "CREATE",
        "EXEC",
        "APPROVALS",
        "POLICY",
        "COMPLETIONS",
        "SERVE",
        "DOCTOR",
    ] {
        assert!(page.contains(&format!(".SH \"WARDEN {sub}\"")), "{sub}");
    }
    assert!(page.contains("\\-\\-memory"), "the options are there");
    // The hidden keeper is not documented as a command for people.
    assert!(!page.contains(".SH \"WARDEN KEEP\""));
}

#[test]
fn a_reader_that_goes_away_ends_the_output_without_a_word() {
    // The reader (`true`) is gone before `warden man` writes: its writes find no reader.
    let out = std::process::Command::new("bash")
        .args([
            "-c",
            &format!("{{ sleep 0.3; exec {BIN} man 2>/tmp/warden-epipe-$$; }} | true; echo ${{PIPESTATUS[0]}}; cat /tmp/warden-epipe-$$; rm -f /tmp/warden-epipe-$$"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "141\n", "{out:?}");
}
