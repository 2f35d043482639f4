//! The Jinja environment transformers renders chat templates in, rebuilt on
//! minijinja.
//!
//! transformers (and so vLLM) compiles a chat template in a sandboxed Jinja2
//! environment with `trim_blocks`, `lstrip_blocks`, `loopcontrols`, no
//! autoescape, the template's trailing newline dropped, its own `tojson`
//! filter (`json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`), and two globals: `raise_exception(msg)` and
//! `strftime_now(fmt)`. This module builds the same on minijinja, plus
//! Python's string and dict methods (`minijinja_contrib::pycompat`).

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// Name the chat template is stored under in its environment.
pub(crate) const TEMPLATE_NAME: &str = "chat_template";

/// The message of a template's `raise_exception(...)` call, carried as the
/// source of the minijinja error so it can be told apart from other errors.
#[derive(Debug, Clone)]
pub(crate) struct Raised(pub(crate) String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// Finds the message of a `raise_exception` call in a render error chain.
pub(crate) fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = source {
        if let Some(r) = e.downcast_ref::<Raised>() {
            return Some(r.0.clone());
        }
        source = e.source();
    }
    None
}

/// Builds the environment holding one compiled chat template.
///
/// # Errors
///
/// The template does not parse (minijinja's syntax error, with line).
pub(crate) fn environment(source: &str) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_template_owned(TEMPLATE_NAME, preprocess(source))?;
    Ok(env)
}

/// Rewrites the parts of HF chat templates that Jinja2 accepts only through
/// transformers' extensions into plain Jinja: `{% generation %}` …
/// `{% endgeneration %}` (transformers' assistant-mask marker, which renders
/// its body unchanged) becomes an always-true `if` block, keeping the tags'
/// whitespace control.
fn preprocess(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_owned();
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body, trail) = split_whitespace_control(inner);
        match body.trim() {
            "generation" => {
                let _ = write!(out, "{{%{lead} if true {trail}%}}");
            }
            "endgeneration" => {
                let _ = write!(out, "{{%{lead} endif {trail}%}}");
            }
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// Splits a tag's inside into its whitespace-control markers (`-`, `+`) and
/// the rest.
fn split_whitespace_control(inner: &str) -> (&str, &str, &str) {
    let lead = if inner.starts_with('-') || inner.starts_with('+') {
        &inner[..1]
    } else {
        ""
    };
    let rest = &inner[lead.len()..];
    let trail = if rest.ends_with('-') || rest.ends_with('+') {
        &rest[rest.len() - 1..]
    } else {
        ""
    };
    (lead, &rest[..rest.len() - trail.len()], trail)
}

/// How a template wants message content: vLLM's `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ContentFormat {
    /// Detect from the template, as vLLM's `auto` does.
    #[default]
    Auto,
    /// Content is one string (text parts joined with `"\n"`).
    String,
    /// Content is a list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

/// vLLM's `auto` content-format detection, on the template source: a
/// template that loops over a message's `content` wants OpenAI parts, any
/// other wants a string.
///
/// vLLM walks the Jinja AST: names assigned from `messages` (directly,
/// sliced, filtered or tested, transitively) are message lists; targets of
/// `for` loops over a message list are messages; a `for` loop over
/// `<message>.content` or `<message>['content']` (possibly sliced, filtered
/// or tested) means OpenAI format. This follows the same rules over the
/// template's `{% … %}` tags.
pub(crate) fn detect_content_format(source: &str) -> ContentFormat {
    let tags: Vec<&str> = tags(source).map(str::trim).collect();
    // Names holding the message list, found breadth-first through `set`s.
    let mut lists: Vec<&str> = vec!["messages"];
    let mut i = 0;
    while i < lists.len() {
        let list = lists[i];
        for tag in &tags {
            if let Some(assign) = tag.strip_prefix("set ")
                && let Some((name, expr)) = assign.split_once('=')
                && access_of(expr, list, None)
            {
                let name = name.trim();
                if is_identifier(name) && !lists.contains(&name) {
                    lists.push(name);
                }
            }
        }
        i += 1;
    }
    let messages: Vec<&str> = tags
        .iter()
        .filter_map(|tag| parse_for(tag))
        .filter(|(_, iterable)| lists.iter().any(|l| access_of(iterable, l, None)))
        .filter_map(|(target, _)| is_identifier(target).then_some(target))
        .collect();
    let loops_over_content = tags
        .iter()
        .filter_map(|tag| parse_for(tag))
        .any(|(_, iterable)| {
            messages
                .iter()
                .any(|m| access_of(iterable, m, Some("content")))
        });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// Whether `expr` is `var` (or `var.key` / `var['key']` with a key),
/// optionally followed by a slice, filters or a test — vLLM's
/// `_is_var_or_elems_access`.
fn access_of(expr: &str, var: &str, key: Option<&str>) -> bool {
    let Some(mut rest) = expr.trim().strip_prefix(var) else {
        return false;
    };
    if rest.starts_with(|c: char| c.is_alphanumeric() || c == '_') {
        return false;
    }
    if let Some(key) = key {
        let dotted = rest
            .trim_start()
            .strip_prefix('.')
            .map(str::trim_start)
            .and_then(|r| r.strip_prefix(key));
        let quoted = ['\'', '"'].iter().find_map(|q| {
            rest.trim_start()
                .strip_prefix('[')
                .map(str::trim_start)
                .and_then(|r| r.strip_prefix(*q))
                .and_then(|r| r.strip_prefix(key))
                .and_then(|r| r.strip_prefix(*q))
                .map(str::trim_start)
                .and_then(|r| r.strip_prefix(']'))
        });
        match dotted.or(quoted) {
            Some(r) if !r.starts_with(|c: char| c.is_alphanumeric() || c == '_') => rest = r,
            _ => return false,
        }
    }
    let rest = rest.trim_start();
    rest.is_empty()
        || rest.starts_with('|')
        || rest.starts_with("is ")
        || (rest.starts_with('[') && rest.split(']').next().is_some_and(|s| s.contains(':')))
}

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// The insides of the `{% … %}` tags of a template, whitespace control
/// stripped.
fn tags(source: &str) -> impl Iterator<Item = &str> {
    source.split("{%").skip(1).filter_map(|s| {
        let inner = s.split("%}").next()?;
        Some(
            inner
                .trim_start_matches(['-', '+'])
                .trim_end_matches(['-', '+']),
        )
    })
}

/// `for target in iterable [if …] [recursive]` → (`target`, `iterable`).
fn parse_for(tag: &str) -> Option<(&str, &str)> {
    let rest = tag.trim().strip_prefix("for ")?;
    let (target, iterable) = rest.split_once(" in ")?;
    let iterable = iterable.split(" if ").next().unwrap_or(iterable);
    let iterable = iterable.trim().trim_end_matches("recursive").trim();
    Some((target.trim(), iterable))
}

/// `raise_exception(message)`: fails the render with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
}

/// `strftime_now(format)`: the current UTC time formatted like Python's
/// `datetime.now().strftime(format)` (transformers' global; engines in
/// containers run on UTC).
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(format, secs)
}

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// Formats a UTC Unix time like C `strftime` (the directives Python
/// documents, plus glibc's `-` flag that drops padding, e.g. `%-d`).
/// Unknown directives are copied through unchanged, as glibc does.
pub(crate) fn strftime(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (
        secs_of_day / 3600,
        (secs_of_day / 60) % 60,
        secs_of_day % 60,
    );
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let weekday_name = WEEKDAYS[weekday];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let no_pad = spec == Some('-');
        if no_pad {
            spec = chars.next();
        }
        let num = |out: &mut String, v: i64, width: usize| {
            if no_pad {
                let _ = write!(out, "{v}");
            } else {
                let _ = write!(out, "{v:0width$}");
            }
        };
        match spec {
            Some('Y') => {
                let _ = write!(out, "{year}");
            }
            Some('y') => num(&mut out, year.rem_euclid(100), 2),
            Some('m') => num(&mut out, month, 2),
            Some('d') => num(&mut out, day, 2),
            Some('e') => {
                let _ = write!(out, "{day:>2}");
            }
            Some('H') => num(&mut out, hour, 2),
            Some('I') => num(&mut out, hour12, 2),
            Some('M') => num(&mut out, minute, 2),
            Some('S') => num(&mut out, second, 2),
            Some('j') => num(&mut out, day_of_year, 3),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b' | 'h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday_name),
            Some('a') => out.push_str(&weekday_name[..3]),
            Some('w') => {
                let _ = write!(out, "{}", (weekday + 1) % 7);
            }
            Some('u') => {
                let _ = write!(out, "{}", weekday + 1);
            }
            Some('F') => {
                let _ = write!(out, "{year}-{month:02}-{day:02}");
            }
            Some('T' | 'X') => {
                let _ = write!(out, "{hour:02}:{minute:02}:{second:02}");
            }
            Some('R') => {
                let _ = write!(out, "{hour:02}:{minute:02}");
            }
            Some('D' | 'x') => {
                let _ = write!(out, "{month:02}/{day:02}/{:02}", year.rem_euclid(100));
            }
            Some('c') => {
                let _ = write!(
                    out,
                    "{} {} {day:>2} {hour:02}:{minute:02}:{second:02} {year}",
                    &weekday_name[..3],
                    &month_name[..3]
                );
            }
            Some('%') => out.push('%'),
            // Naive datetimes have no zone: Python prints nothing.
            Some('Z' | 'z') => {}
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
            }
        }
    }
    out
}

/// Days since 1970-01-01 → (year, month 1–12, day 1–31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// (year, month, day) → days since 1970-01-01.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Debug, Clone, Default)]
pub(crate) struct DumpOptions {
    pub(crate) ensure_ascii: bool,
    pub(crate) indent: Option<String>,
    pub(crate) item_separator: Option<String>,
    pub(crate) key_separator: Option<String>,
    pub(crate) sort_keys: bool,
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, positional or keyword.
// minijinja passes filter arguments by value (and `Kwargs` must be owned to
// track which were used).
#[allow(clippy::needless_pass_by_value)]
fn tojson(value: &Value, args: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let mut opts = DumpOptions::default();
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let mut given: Vec<(&str, Value)> = names.iter().copied().zip(args.iter().cloned()).collect();
    for name in names {
        if kwargs.has(name) {
            given.push((name, kwargs.get::<Value>(name)?));
        }
    }
    kwargs.assert_all_used()?;
    for (name, v) in given {
        match name {
            "ensure_ascii" => opts.ensure_ascii = v.is_true(),
            "sort_keys" => opts.sort_keys = v.is_true(),
            "indent" => {
                opts.indent = if v.is_none() || v.is_undefined() {
                    None
                } else if let Some(s) = v.as_str() {
                    Some(s.to_owned())
                } else if let Some(n) = v.as_i64() {
                    Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
                } else {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    ));
                };
            }
            _ => {
                if !(v.is_none() || v.is_undefined()) {
                    let parts: Vec<Value> = v.try_iter()?.collect();
                    match parts.as_slice() {
                        [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                            opts.item_separator = item.as_str().map(str::to_owned);
                            opts.key_separator = key.as_str().map(str::to_owned);
                        }
                        _ => {
                            return Err(Error::new(
                                ErrorKind::InvalidOperation,
                                "tojson: separators must be a pair of strings",
                            ));
                        }
                    }
                }
            }
        }
    }
    let mut out = String::new();
    dump(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Python's `json.dumps` over a template value.
pub(crate) fn dump(
    value: &Value,
    opts: &DumpOptions,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    if depth > 512 {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => push_number(value, out),
        ValueKind::String => {
            push_json_string(value.as_str().unwrap_or_default(), opts.ensure_ascii, out);
        }
        ValueKind::Seq => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator(opts));
                }
                newline_indent(opts, depth + 1, out);
                dump(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_separator(opts));
                }
                newline_indent(opts, depth + 1, out);
                push_json_string(key, opts.ensure_ascii, out);
                out.push_str(opts.key_separator.as_deref().unwrap_or(": "));
                dump(item, opts, depth + 1, out)?;
            }
            newline_indent(opts, depth, out);
            out.push('}');
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "Object of type Undefined is not JSON serializable",
            ));
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {other} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

fn item_separator(opts: &DumpOptions) -> &str {
    match (&opts.item_separator, &opts.indent) {
        (Some(sep), _) => sep,
        (None, Some(_)) => ",",
        (None, None) => ", ",
    }
}

fn newline_indent(opts: &DumpOptions, depth: usize, out: &mut String) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// A map key as Python's `json.dumps` converts it.
fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::Number => {
            let mut s = String::new();
            push_number(key, &mut s);
            s
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("keys must be str, int, float, bool or None, not {other}"),
            ));
        }
    })
}

fn push_number(value: &Value, out: &mut String) {
    if value.is_integer() {
        // Integers print in decimal, whatever their width.
        let _ = write!(out, "{value}");
    } else {
        let f = f64::try_from(value.clone()).unwrap_or(f64::NAN);
        out.push_str(&py_float_repr(f));
    }
}

/// Python's `float.__repr__` as `json.dumps` prints it (`NaN`, `Infinity`
/// for the non-finite values).
pub(crate) fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    // Rust's `{:e}` prints the shortest digits that round-trip, like Python.
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let n = digits.len() as i32;
    // Position of the decimal point relative to the digit string.
    let decpt = exp + 1;
    let mut out = String::with_capacity(24);
    if f < 0.0 {
        out.push('-');
    }
    if (-4 < decpt) && (decpt <= 16) {
        if decpt <= 0 {
            out.push_str("0.");
            for _ in 0..(-decpt) {
                out.push('0');
            }
            out.push_str(&digits);
        } else if decpt >= n {
            out.push_str(&digits);
            for _ in 0..(decpt - n) {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..decpt as usize]);
            out.push('.');
            out.push_str(&digits[decpt as usize..]);
        }
    } else {
        out.push_str(&digits[..1]);
        if n > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let e = decpt - 1;
        let _ = write!(out, "e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    out
}

/// A JSON string as Python's `json.dumps` writes it.
pub(crate) fn push_json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.reserve(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A JSON value as a template value: objects keep their key order (the
/// workspace enables `preserve_order` in both serde_json and minijinja),
/// integers stay integers, floats stay floats.
pub(crate) fn json_to_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::from(()),
        serde_json::Value::Bool(b) => Value::from(*b),
        serde_json::Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        serde_json::Value::String(s) => Value::from(Arc::<str>::from(s.as_str())),
        serde_json::Value::Array(items) => items.iter().map(json_to_value).collect(),
        serde_json::Value::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

#[cfg(test)]
mod tests;
